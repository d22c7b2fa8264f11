"""Files kept between runs in the temp folder (the random checkpoints of ``sgld bench --size`` and the torchrun
launch) live in this user's 0700 folder; a folder someone else could have planted is refused, not used."""
import os
import stat
import tempfile

import pytest

from engine.io.atomic import private_dir
from engine.models.random_weights import random_checkpoint


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_random_checkpoints_live_in_a_private_folder(temp_root):
    path = random_checkpoint("tiny")
    folder = os.path.dirname(path)
    st = os.lstat(folder)
    assert os.path.dirname(folder) == str(temp_root) and st.st_uid == os.getuid()
    assert stat.S_IMODE(st.st_mode) == 0o700
    assert random_checkpoint("tiny") == path  # written once, found again


@pytest.mark.parametrize("plant", ["open folder", "link"])
def test_a_planted_folder_is_refused(temp_root, plant):
    planted = temp_root / f"sgld-random-{os.getuid()}"
    if plant == "open folder":
        planted.mkdir()
        planted.chmod(0o777)
    else:
        (temp_root / "elsewhere").mkdir(mode=0o700)
        planted.symlink_to(temp_root / "elsewhere")
    with pytest.raises(OSError, match="not a private folder of this user"):
        random_checkpoint("tiny")
    with pytest.raises(OSError, match="mode 0700"):
        private_dir("sgld-random")
