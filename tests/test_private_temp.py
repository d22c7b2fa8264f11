"""Files kept between runs (the random checkpoints of ``sgld bench --size`` and the torchrun launch) live in this
user's 0700 folder under the user's cache folder, not in the shared temp folder; a folder that is not private
(a link, an open folder) is refused, not used."""
import os
import stat

import pytest

from engine.io.atomic import private_dir
from engine.models.random_weights import random_checkpoint


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """The user's cache folder (``XDG_CACHE_HOME``) in this test's own folder; its ``sgld/`` holds the folders."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "sgld"


def test_random_checkpoints_live_in_a_private_folder(temp_root):
    path = random_checkpoint("tiny")
    folder = os.path.dirname(path)
    st = os.lstat(folder)
    assert os.path.dirname(folder) == str(temp_root) and st.st_uid == os.getuid()
    assert stat.S_IMODE(st.st_mode) == 0o700
    assert random_checkpoint("tiny") == path  # written once, found again


def test_without_xdg_cache_home_the_folder_is_in_the_home_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert private_dir("sgld-random") == str(tmp_path / "home" / ".cache" / "sgld" / "sgld-random")


@pytest.mark.parametrize("plant", ["open folder", "link"])
def test_a_planted_folder_is_refused(temp_root, plant):
    temp_root.mkdir(mode=0o700)
    planted = temp_root / "sgld-random"
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
