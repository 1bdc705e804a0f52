"""The one exceptions module. A DflashqError carries one sentence naming what the user must fix."""


class DflashqError(Exception):
    """An error the user can fix; the CLI prints its message (no traceback) and exits with `exit_code`."""

    exit_code = 2


class ConfigError(DflashqError):
    """A bad config file, flag or environment variable."""


class ManifestMismatch(DflashqError):
    """A command's config disagrees with the run manifest written on first use."""


class RedisUnavailable(DflashqError):
    """The run's Redis cannot be reached."""


class InputError(DflashqError):
    """A missing input file, model folder or unreadable dataset."""


class ChildFailed(DflashqError):
    """`dflashq up`: a child process kept exiting with a user error, so the supervisor stopped the run."""


class BlobError(DflashqError):
    """A blob that is corrupt, truncated or of an unknown format version."""

    exit_code = 1


class JobRefused(Exception):
    """A job that is not the registered extraction function (or not JSON) reached a worker."""


class VerificationFailed(DflashqError):
    """`dflashq verify` found all-zero, non-finite or mismatched hidden states."""

    exit_code = 1


class RejectedSample(Exception):
    """One dataset record that cannot become a training sample; `reason` is a short, stable string for counting."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class TrainerOutOfMemory(DflashqError):
    """A training step did not fit the device's memory. Often transient (another process held the GPU for a while),
    so `dflashq up` starts the trainer again a few times (defaults.OUT_OF_MEMORY_RETRIES) before it stops the run."""

    exit_code = 3
