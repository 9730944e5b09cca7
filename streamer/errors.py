"""Errors a user can cause. Each carries a message fit to show as is."""


class StreamerError(Exception):
    """Base class: a clear, user-facing error (never a bug)."""


class ModelLoadError(StreamerError):
    """A model folder that cannot be loaded: names the file and the tensor."""


class ConfigError(StreamerError):
    """An invalid engine or server setting."""


class RequestError(StreamerError):
    """A request that cannot be served (too long, bad parameters, bad grammar)."""


class LoraNotFound(RequestError):
    """Unloading a LoRA adapter by a name no adapter has (the server's 404)."""
