"""Every error the engine raises for bad input or a failed run: one place, so callers (the CLI, the
nodes, the server) catch them without importing the features, and every message names the file,
field, option or variable and what is allowed."""


class CheckpointError(ValueError):
    """A model file that cannot be used; the message names the file and the problem."""


class LoRAError(CheckpointError):
    """A LoRA file that cannot be applied to this model; the message names the file and the problem."""


class InputError(ValueError):
    """Inputs that do not fit the model (latent shape, conditioning, settings); the message says which and why."""


class ModelOutputError(InputError):
    """The model's output held NaN or inf (damaged weights, an overflowing dtype): the run stops at that
    step instead of making a blank picture. An InputError, so the nodes and the CLI report it as one."""


class CacheConfigError(ValueError):
    """An invalid cache option; the message names the variable or field and the allowed values."""


class ParallelConfigError(ValueError):
    """Degrees that cannot work (world size, heads, GPUs); the message says which and what to change."""


class ParallelWorkerError(RuntimeError):
    """A worker died, failed or stopped answering; the pool was stopped and restarts on the next run."""


class Cancelled(RuntimeError):
    """A run its caller stopped (a server request past --request-timeout, or whose client left): it ended at
    its next step instead of running on for nobody. Not a user error: nobody reads its result."""


USER_ERRORS = (CheckpointError, InputError, CacheConfigError, ParallelConfigError, ParallelWorkerError)
