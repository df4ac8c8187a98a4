"""The requests :mod:`ddpckpt.storage.s3` makes: one boto3 client per endpoint, every request
bounded (timeouts, retries with backoff), its errors raised as :class:`OSError` subclasses a
caller can classify (:class:`FileNotFoundError`, :class:`PermissionError`,
:class:`TimeoutError`, :class:`ConnectionError`), and ``storage_options`` read into client
settings. Credentials stay inside the client: never logged, never in a message or repr.
"""

from __future__ import annotations

import copy
import errno
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

try:
    import boto3
    import botocore.config
    import botocore.exceptions
    from boto3.s3.transfer import TransferConfig as TransferConfig
except ImportError as _missing:  # pragma: no cover - depends on the installation
    raise ImportError("s3:// locations need boto3: pip install 'ddpckpt[s3]'") from _missing

from ddpckpt._log import get_logger
from ddpckpt.storage._errors import BucketNotFoundError

SCHEME = "s3://"
CLIENT_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
_log = get_logger(__name__)
_T = TypeVar("_T")
_CLIENT = (  # S3Requests' own arguments, which storage_options may set
    "endpoint_url",
    "region_name",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "profile_name",
    "connect_timeout",
    "read_timeout",
    "max_attempts",
)
_STORAGE = ("part_size", "max_concurrency", "small_object")  # S3Storage's
_ALIASES = {  # the names s3fs (and so DCP's fsspec users) pass
    "region": "region_name",
    "key": "aws_access_key_id",
    "username": "aws_access_key_id",
    "secret": "aws_secret_access_key",
    "password": "aws_secret_access_key",
    "token": "aws_session_token",
    "profile": "profile_name",
}
_OPTION_NAMES = {**{name: name for name in (*_CLIENT, *_STORAGE)}, **_ALIASES}


def settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``S3Storage`` arguments a ``storage_options`` mapping sets (see
    :meth:`~ddpckpt.storage.s3.S3Storage.from_options`); :class:`ValueError` naming an
    unknown or twice-given option, never a value."""
    arguments: dict[str, Any] = {}
    given: dict[str, str] = {}

    def take(name: str, value: Any, where: str) -> None:
        target = _OPTION_NAMES.get(name)
        if target is None:
            known = ", ".join(sorted({*_OPTION_NAMES, "client_kwargs", "config_kwargs"}))
            raise ValueError(f"storage_options: unknown S3 option {where!r} (known: {known})")
        if target in arguments and arguments[target] != value:
            raise ValueError(f"storage_options: {given[target]!r} and {where!r} both set {target}")
        arguments[target], given[target] = value, where

    for name, value in options.items():
        if name not in ("client_kwargs", "config_kwargs"):
            take(name, value, name)
            continue
        for inner, inner_value in dict(value or {}).items():
            if name == "config_kwargs" and inner == "retries":
                retries = dict(inner_value or {})
                for count in ("max_attempts", "total_max_attempts"):  # retries vs attempts
                    if count in retries:
                        attempts = int(retries[count]) - (count == "total_max_attempts")
                        take("max_attempts", attempts, f"{name}.retries.{count}")
                continue
            take(inner, inner_value, f"{name}.{inner}")
    return arguments


_DENIED = {  # error code: what to do
    "AccessDenied": "check that these credentials may use this bucket (its policy, the IAM role)",
    "AllAccessDisabled": "access to this bucket is disabled: use another bucket",
    "AccountProblem": "the account behind these credentials has a problem: see its console",
    "InvalidAccessKeyId": "the access key is unknown to this endpoint: check the credentials "
    "(AWS_ACCESS_KEY_ID, storage_options key=) and that the endpoint is the intended one",
    "SignatureDoesNotMatch": "the secret key does not match the access key: check the credentials",
    "ExpiredToken": "the session credentials have expired: renew them (aws sso login, a new "
    "STS token) and start again",
    "InvalidToken": "the session token is invalid: renew the credentials",
    "TokenRefreshRequired": "the session credentials have expired: renew them",
}
_ELSEWHERE = (  # the bucket lives in another region than the one the request was signed for
    "PermanentRedirect",
    "AuthorizationHeaderMalformed",
    "IllegalLocationConstraintException",
)
_REGION_HINT = "the bucket is in another region: set storage_options region_name= or AWS_REGION"
_ENDPOINT_HINT = (
    "check the endpoint (storage_options endpoint_url=, AWS_ENDPOINT_URL) and that the server runs"
)
_PROFILE_HINT = (
    "name a profile of ~/.aws/config or ~/.aws/credentials (AWS_PROFILE, storage_options "
    "profile=), or unset AWS_PROFILE to use the other usual places"
)
_CREDENTIALS_HINT = (
    "give credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile "
    "(AWS_PROFILE, storage_options profile=), an instance role, or storage_options key=/secret="
)


def os_error(exc: Exception, location: str) -> OSError:
    """The :class:`OSError` a caller can classify, for a client exception on ``location``;
    its message names the S3 error and says what to do."""
    if isinstance(exc, botocore.exceptions.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        text = f"{code or status}: {error.get('Message', '') or exc}"
        if code == "NoSuchBucket":
            return BucketNotFoundError(
                errno.ENOENT, f"{text} (create it, or correct the bucket's name)", location
            )
        if code in ("NoSuchKey", "NotFound", "404") or status == 404:
            return FileNotFoundError(errno.ENOENT, text, location)
        if code in _DENIED or code == "403" or status == 403:
            hint = _DENIED.get(code, _DENIED["AccessDenied"])
            return PermissionError(errno.EACCES, f"{text} ({hint})", location)
        if code in _ELSEWHERE or status == 301:
            return OSError(errno.EIO, f"{text} ({_REGION_HINT})", location)
        return OSError(errno.EIO, text, location)
    if isinstance(
        exc, botocore.exceptions.NoCredentialsError | botocore.exceptions.PartialCredentialsError
    ):
        return PermissionError(
            errno.EACCES, f"no usable S3 credentials ({exc}): {_CREDENTIALS_HINT}", location
        )
    if isinstance(
        exc, (botocore.exceptions.ConnectTimeoutError, botocore.exceptions.ReadTimeoutError)
    ):
        return TimeoutError(
            errno.ETIMEDOUT, f"S3 request timed out ({exc}); {_ENDPOINT_HINT}", location
        )
    if isinstance(
        exc, botocore.exceptions.EndpointConnectionError | botocore.exceptions.ConnectionClosedError
    ):
        return ConnectionError(
            errno.ECONNREFUSED, f"S3 endpoint unreachable ({exc}); {_ENDPOINT_HINT}", location
        )
    return OSError(errno.EIO, f"S3 request failed ({type(exc).__name__}: {exc})", location)


_UNANSWERED = (
    botocore.exceptions.ConnectTimeoutError,
    botocore.exceptions.ReadTimeoutError,
    botocore.exceptions.EndpointConnectionError,
    botocore.exceptions.ConnectionClosedError,
)


class _UnansweredWarning:
    """Says at once, on stderr, that the server does not answer and how long the retries
    may hold the caller (a sync save holds training), instead of silence until the last
    attempt fails. Once until a request succeeds again."""

    def __init__(self, retries: int, connect_timeout: float, read_timeout: float) -> None:
        self._retries, self._timeouts = retries, (connect_timeout, read_timeout)
        self._warned = False

    def __call__(
        self, attempts: int, caught_exception: Exception | None = None, **kwargs: Any
    ) -> None:
        if caught_exception is None:
            self._warned = False
        elif isinstance(caught_exception, _UNANSWERED) and not self._warned:
            self._warned = True
            endpoint, operation = kwargs.get("endpoint"), kwargs.get("operation")
            connect, read = self._timeouts
            _log.warning(
                "S3 %s at %s got no answer (%s); retrying up to %d times, each attempt "
                "waiting up to %.0f s to connect and %.0f s for the answer (storage_options "
                "connect_timeout=, read_timeout=, max_attempts= shorten this)",
                getattr(operation, "name", "request"),
                getattr(endpoint, "host", "the endpoint"),
                type(caught_exception).__name__,
                self._retries,
                connect,
                read,
            )
        return None  # the retry handler decides


class EmptyObject(Exception):
    """A ranged GET of an object without bytes (HTTP 416)."""


def error_code(exc: Exception) -> str:
    if not isinstance(exc, botocore.exceptions.ClientError):
        return ""
    return str(exc.response.get("Error", {}).get("Code", ""))


def _is_precondition_failure(exc: Exception) -> bool:
    if not isinstance(exc, botocore.exceptions.ClientError):
        return False
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return error_code(exc) in ("PreconditionFailed", "ConditionalRequestConflict") or status in (
        409,
        412,
    )


def split(location: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` as ``("bucket", "a/b")``; repeated or trailing slashes are one
    (``s3://bucket/run/`` is ``run``). A ``.`` or ``..`` segment is refused
    (:class:`ValueError`): an object key is a name, not a path, so none is resolved into
    another key (listings never yield such names: :mod:`~ddpckpt.storage._names`)."""
    if not location.startswith(SCHEME):
        raise ValueError(f"{location}: not an {SCHEME} location")
    parts = [p for p in location[len(SCHEME) :].split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise ValueError(
            f"{location}: a '.' or '..' segment in an {SCHEME} location; object keys are "
            "names, not paths: write the location without it"
        )
    if not parts:
        raise ValueError(f"{location}: name a bucket, as in {SCHEME}BUCKET/prefix")
    return parts[0], "/".join(parts[1:])


class S3Requests:
    """One endpoint's boto3 client and the requests made through it. Arguments left
    ``None`` come from boto3's usual places (``AWS_ENDPOINT_URL``, ``AWS_REGION``, the
    credential variables, ``~/.aws/config``/``credentials``, instance roles)."""

    def __init__(
        self,
        *,
        endpoint_url: str | None = None,
        region_name: str | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
        profile_name: str | None = None,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        max_attempts: int = 5,
        connections: int = 18,
    ) -> None:
        self._connections = connections
        try:  # a profile that is not there (AWS_PROFILE, profile=) fails here
            self._session = boto3.session.Session(profile_name=profile_name)
            self._client_options = {  # holds credentials: never logged, never in repr
                "endpoint_url": endpoint_url,
                "region_name": region_name or self._session.region_name or "us-east-1",
                "aws_access_key_id": aws_access_key_id,
                "aws_secret_access_key": aws_secret_access_key,
                "aws_session_token": aws_session_token,
            }
            self.client = self._make_client(max_attempts, connect_timeout, read_timeout)
        except botocore.exceptions.ProfileNotFound as exc:
            raise ValueError(f"S3 client settings: {exc}: {_PROFILE_HINT}") from None
        except botocore.exceptions.BotoCoreError as exc:  # e.g. a key without its secret
            raise ValueError(f"S3 client settings: {exc}") from None
        self.conditional_writes = True

    def _make_client(self, retries: int, connect_timeout: float, read_timeout: float) -> Any:
        config = botocore.config.Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"total_max_attempts": retries + 1, "mode": "standard"},
            max_pool_connections=self._connections,
        )
        client = self._session.client("s3", config=config, **self._client_options)
        if retries:
            warn = _UnansweredWarning(retries, connect_timeout, read_timeout)
            client.meta.events.register("needs-retry.s3", warn)
        return client

    def best_effort(self) -> S3Requests:
        """These requests tried once, with 2 s to connect and 5 s to answer."""
        quick = copy.copy(self)
        quick.client = self._make_client(0, 2.0, 5.0)
        return quick

    @property
    def endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)

    def call(
        self, location: str, operation: Callable[..., _T], *, exclusive: bool = False, **kwargs: Any
    ) -> _T:
        """``operation(**kwargs)``, its client errors raised as :class:`OSError` (a failed
        precondition of an ``exclusive`` write as :class:`FileExistsError`). A server
        without conditional writes gets them unconditionally (after one warning)."""
        if not self.conditional_writes:
            kwargs.pop("IfNoneMatch", None)
        try:
            return operation(**kwargs)
        except CLIENT_ERRORS as exc:
            if "IfNoneMatch" in kwargs and error_code(exc) == "NotImplemented":
                _log.warning(
                    "%s: the S3 server does not support conditional writes (If-None-Match); "
                    "exclusive creates are checked before writing only, so two jobs saving "
                    "to one prefix at the same moment are not detected",
                    location,
                )
                self.conditional_writes = False
                return self.call(location, operation, exclusive=exclusive, **kwargs)
            if exclusive and _is_precondition_failure(exc):
                raise FileExistsError(errno.EEXIST, "object exists", location) from None
            raise os_error(exc, location) from exc

    def get_object(self, location: str, **kwargs: Any) -> tuple[bytes, dict[str, Any]]:
        """The body and the response of a GET; :class:`EmptyObject` for a range of an
        empty object."""
        bucket, key = split(location)
        try:
            response = self.client.get_object(Bucket=bucket, Key=key, **kwargs)
            return response["Body"].read(), response
        except CLIENT_ERRORS as exc:
            if "Range" in kwargs and error_code(exc) == "InvalidRange":
                raise EmptyObject from None  # no byte 0: the object exists and is empty
            raise os_error(exc, location) from exc

    def get(self, location: str, **kwargs: Any) -> bytes:
        return self.get_object(location, **kwargs)[0]

    def put_new(self, location: str, data: bytes) -> None:
        """Upload ``data`` unless ``location`` exists (:class:`FileExistsError`)."""
        bucket, key = split(location)
        self.call(
            location,
            self.client.put_object,
            exclusive=True,
            Bucket=bucket,
            Key=key,
            Body=data,
            IfNoneMatch="*",
        )

    def head(self, location: str) -> dict[str, Any]:
        bucket, key = split(location)
        if not key:
            raise IsADirectoryError(errno.EISDIR, "a bucket is no object", location)
        return self.call(location, self.client.head_object, Bucket=bucket, Key=key)
