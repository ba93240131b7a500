"""Typed errors for everything a user can get wrong.

Every error names the offending value and the limit it broke, so a message alone tells the
user what to change. Errors about one request never disturb the other requests of a batch.
"""

from __future__ import annotations


class PagedqError(Exception):
    """Base class of every error pagedq raises on purpose."""


# --- model folders and checkpoints -------------------------------------------------------


class ModelLoadError(PagedqError):
    """A model folder cannot be used: missing, unreadable or inconsistent."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model path, or a file the folder must contain, does not exist."""


class CheckpointError(ModelLoadError):
    """A weight file is corrupt, truncated, or does not match the model config."""


class UnsupportedModelError(ModelLoadError):
    """The architecture, dtype or quantization setting is not one pagedq runs."""


class TokenizerError(ModelLoadError):
    """The tokenizer files or the chat template are missing or invalid."""


# --- configuration and requests ----------------------------------------------------------


class ConfigError(PagedqError, ValueError):
    """An engine setting is out of range or inconsistent with the model or the device."""


class InvalidRequestError(PagedqError, ValueError):
    """A request cannot be served; raised by `add_request`, other requests are untouched."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one new token) does not fit `max_model_len`."""


class RequestTooLargeError(InvalidRequestError):
    """The request could not fit in the KV pool even if it ran alone."""


class InvalidTokenIdError(InvalidRequestError):
    """A prompt token id is outside `[0, vocab_size)`."""


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is outside its valid range."""


class DuplicateRequestError(InvalidRequestError):
    """A request id is already in use by an unfinished request."""
