"""S3-compatible object storage: ``s3://bucket/prefix`` (extra ``ddpckpt[s3]``).

A checkpoint commits with :class:`~ddpckpt.storage.base.ManifestLastCommit`: every rank
uploads its data objects under the checkpoint's prefix, the leader uploads the manifest
last, and only a prefix whose manifest exists (and whose objects match its sizes and
checksums on load) is a checkpoint. ``latest`` is replaced after the manifest's upload has
completed, so it never names an uncommitted prefix.

Client library: boto3. It is the reference client (maintained by AWS, weekly releases),
speaks every S3 feature this module needs — conditional writes (``If-None-Match: *`` for
exclusive creates, ``If-Match`` for reads of the version that was opened), multipart
upload, server-side copy, batched delete — and reads endpoint and credentials from the
standard places (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``..., ``~/.aws/config`` and
``credentials``, profiles, instance roles). obstore is faster per request but exposes
neither multipart parts nor conditional completes; s3fs pulls aiobotocore and an event
loop thread. Measured against a local S3 server, throughput is bounded by the server and
the number of parallel requests, not by the client, so parallelism is done here: parts
of an upload and ranges of a read go out on a thread pool.

Limits: ``create`` is exclusive (checked when opened, enforced by a conditional write at
the end). A reader of an object up to ``small_object`` bytes downloads it when opened, so
it keeps those bytes; a larger one reads ranges of the version it opened (``If-Match``)
and raises :class:`OSError` if that object is replaced meanwhile. ``rename`` and
``delete_tree`` copy/delete object by object and are not atomic (the commit never relies
on them). ``age`` compares the server's clock with this machine's.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

try:
    import boto3
    import botocore.config
    import botocore.exceptions
except ImportError as _missing:  # pragma: no cover - depends on the installation
    raise ImportError("s3:// locations need boto3: pip install 'ddpckpt[s3]'") from _missing

from ddpckpt._log import get_logger
from ddpckpt.storage.base import ManifestLastCommit, Reader, Storage, Writer

__all__ = ["SCHEME", "S3Storage"]

SCHEME = "s3://"
_MiB = 1 << 20
_DELETE_BATCH = 1000  # the most keys one DeleteObjects request takes
_LIST_PAGE = 1000  # keys per ListObjectsV2 page (the server's maximum)
_log = get_logger(__name__)
_T = TypeVar("_T")
_ARGUMENTS = (
    "endpoint_url",
    "region_name",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "profile_name",
    "connect_timeout",
    "read_timeout",
    "max_attempts",
    "part_size",
    "max_concurrency",
    "small_object",
)
_OPTION_NAMES = {  # storage_options names (ours, boto3's and s3fs's) -> S3Storage arguments
    **{name: name for name in _ARGUMENTS},
    "region": "region_name",
    "key": "aws_access_key_id",
    "username": "aws_access_key_id",
    "secret": "aws_secret_access_key",
    "password": "aws_secret_access_key",
    "token": "aws_session_token",
    "profile": "profile_name",
}


def _os_error(exc: Exception, location: str) -> OSError:
    """The :class:`OSError` a caller can classify, for a client exception on ``location``."""
    if isinstance(exc, botocore.exceptions.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        text = f"{code or status}: {error.get('Message', '') or exc}"
        if code in ("NoSuchKey", "NoSuchBucket", "NotFound", "404") or status == 404:
            return FileNotFoundError(errno.ENOENT, text, location)
        if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return PermissionError(errno.EACCES, text, location)
        return OSError(errno.EIO, text, location)
    if isinstance(
        exc, (botocore.exceptions.ConnectTimeoutError, botocore.exceptions.ReadTimeoutError)
    ):
        return TimeoutError(errno.ETIMEDOUT, f"S3 request timed out ({exc})", location)
    if isinstance(exc, botocore.exceptions.EndpointConnectionError):
        return ConnectionError(errno.ECONNREFUSED, f"S3 endpoint unreachable ({exc})", location)
    return OSError(errno.EIO, f"S3 request failed ({type(exc).__name__}: {exc})", location)


class _EmptyObject(Exception):
    """A ranged GET of an object without bytes (HTTP 416)."""


def _error_code(exc: Exception) -> str:
    if not isinstance(exc, botocore.exceptions.ClientError):
        return ""
    return str(exc.response.get("Error", {}).get("Code", ""))


def _is_precondition_failure(exc: Exception) -> bool:
    if not isinstance(exc, botocore.exceptions.ClientError):
        return False
    code = _error_code(exc)
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


_CLIENT_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)


class _S3Writer(Writer):
    """Buffers writes; past ``part_size`` bytes it becomes a multipart upload whose parts
    go out concurrently as they fill. ``sync`` completes the upload; ``close`` without
    ``sync`` (or any failure) aborts it, so no partial object is ever visible."""

    def __init__(self, store: S3Storage, location: str) -> None:
        self._store, self._location = store, location
        self._bucket, self._key = store._split(location)
        self._buffer: bytearray | None = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._done = False

    def write(self, data: Any) -> None:
        if self._buffer is None:
            raise ValueError(f"{self._location}: write after close")
        self._buffer += memoryview(data).cast("B")
        while len(self._buffer) >= self._store.part_size:
            part = bytes(self._buffer[: self._store.part_size])
            del self._buffer[: self._store.part_size]
            self._send_part(part)

    def _send_part(self, part: bytes) -> None:
        store = self._store
        try:
            if self._upload_id is None:
                self._upload_id = store._call(
                    self._location,
                    store._client.create_multipart_upload,
                    Bucket=self._bucket,
                    Key=self._key,
                )["UploadId"]
            # Bound the bytes in flight: wait for the oldest part before queueing more.
            pending = [f for f in self._parts if not f.done()]
            if len(pending) >= store.max_concurrency:
                pending[0].result()
        except BaseException:
            self._abort()
            raise
        number = len(self._parts) + 1
        self._parts.append(store._pool.submit(self._upload_part, number, part))

    def _upload_part(self, number: int, part: bytes) -> dict[str, Any]:
        response = self._store._call(
            self._location,
            self._store._client.upload_part,
            Bucket=self._bucket,
            Key=self._key,
            UploadId=self._upload_id,
            PartNumber=number,
            Body=part,
        )
        return {"PartNumber": number, "ETag": response["ETag"]}

    def sync(self) -> None:
        if self._buffer is None:
            raise ValueError(f"{self._location}: sync after close")
        store = self._store
        try:
            if self._upload_id is None:
                store._put_new(self._location, bytes(self._buffer))
            else:
                if self._buffer:
                    self._send_part(bytes(self._buffer))
                parts = [f.result() for f in self._parts]
                store._call(
                    self._location,
                    store._client.complete_multipart_upload,
                    exclusive=True,
                    Bucket=self._bucket,
                    Key=self._key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},
                    IfNoneMatch="*",
                )
        except BaseException:
            self._abort()
            raise
        self._buffer.clear()
        self._done = True

    def _abort(self) -> None:
        upload_id, self._upload_id = self._upload_id, None
        for future in self._parts:
            future.cancel()
        if upload_id is None:
            return
        for future in self._parts:  # let running parts end before the upload goes
            if not future.cancelled():
                with contextlib.suppress(BaseException):  # its error is raised already
                    future.exception()
        try:
            self._store._client.abort_multipart_upload(
                Bucket=self._bucket, Key=self._key, UploadId=upload_id
            )
        except _CLIENT_ERRORS as exc:
            _log.warning(
                "%s: could not abort an unfinished multipart upload (%s); a bucket lifecycle "
                "rule for incomplete uploads removes its parts",
                self._location,
                _os_error(exc, self._location),
            )

    def close(self) -> None:
        if self._buffer is None:
            return
        if not self._done:
            self._abort()
        self._buffer = None


class _S3Reader(Reader):
    """A small object is downloaded when opened; a larger one is read by ranged GETs of
    the version that was opened, in parallel for long reads."""

    def __init__(self, store: S3Storage, location: str) -> None:
        self._store, self._location = store, location
        self._data: bytes | None = None
        # One request tells the size and version and, for a small object, brings it all.
        try:
            data, response = store._get_object(location, Range=f"bytes=0-{store.small_object - 1}")
        except _EmptyObject:
            self.size, self._etag, self._data = 0, "", b""
            return
        total = str(response.get("ContentRange", "")).rpartition("/")[2]
        self.size = int(total) if total.isdigit() else len(data)
        self._etag = response["ETag"]
        if len(data) == self.size:
            self._data = data

    def _get_range(self, view: memoryview, offset: int) -> None:
        data = self._store._get(
            self._location,
            Range=f"bytes={offset}-{offset + len(view) - 1}",
            IfMatch=self._etag,
        )
        if len(data) != len(view):
            raise OSError(
                errno.EIO, f"short ranged read ({len(data)} of {len(view)} bytes)", self._location
            )
        view[:] = data

    def read_into(self, view: memoryview, offset: int) -> int:
        count = max(0, min(len(view), self.size - offset))
        if count == 0:
            return 0
        if self._data is not None:
            view[:count] = self._data[offset : offset + count]
            return count
        chunk = self._store.part_size
        starts = range(0, count, chunk)
        futures = [
            self._store._pool.submit(
                self._get_range, view[start : min(start + chunk, count)], offset + start
            )
            for start in starts
        ]
        for future in futures:
            future.result()
        return count

    def map(self) -> Any:
        if self.size == 0:
            return None
        buffer = bytearray(self.size)
        self.read_into(memoryview(buffer), 0)
        return buffer

    def close(self) -> None:
        self._data = None


class S3Storage(Storage):
    """``s3://bucket/key`` locations on one S3 endpoint (any bucket).

    Arguments left ``None`` come from boto3's usual places: ``AWS_ENDPOINT_URL``,
    ``AWS_REGION``, the credential variables, ``~/.aws/config``/``credentials``, instance
    roles. Every request times out (``connect_timeout``, ``read_timeout`` seconds) and is
    retried at most ``max_attempts`` times with backoff. Objects over ``part_size`` bytes
    are uploaded in parts, ``max_concurrency`` at a time; reads over ``part_size`` go out
    as that many parallel ranged GETs. Credentials are never logged.

    Serve a URL prefix from a configured instance with::

        ddpckpt.storage.mount("s3://bucket", S3Storage(endpoint_url="http://host:9000"))
    """

    commit = ManifestLastCommit()

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
        part_size: int = 32 * _MiB,
        max_concurrency: int = 8,
        small_object: int = 8 * _MiB,
    ) -> None:
        if part_size < 5 * _MiB:
            raise ValueError(f"part_size={part_size}: S3 parts are at least 5 MiB")
        self.part_size, self.max_concurrency, self.small_object = (
            part_size,
            max_concurrency,
            small_object,
        )
        self._session = boto3.session.Session(profile_name=profile_name)
        self._client_options = {  # holds credentials: never logged, never in repr
            "endpoint_url": endpoint_url,
            "region_name": region_name or self._session.region_name or "us-east-1",
            "aws_access_key_id": aws_access_key_id,
            "aws_secret_access_key": aws_secret_access_key,
            "aws_session_token": aws_session_token,
        }
        try:
            self._client = self._make_client(max_attempts, connect_timeout, read_timeout)
        except botocore.exceptions.BotoCoreError as exc:  # e.g. a key without its secret
            raise ValueError(f"S3 client settings: {exc}") from None
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="ddpckpt-s3")
        self._conditional_writes = True

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> S3Storage:
        """A storage made from a ``storage_options`` mapping, in this class's argument
        names or in those s3fs/fsspec users pass: ``key``/``secret``/``token``,
        ``profile``, ``region``, ``client_kwargs`` (``endpoint_url``, ``region_name``,
        credentials) and ``config_kwargs`` (``connect_timeout``, ``read_timeout``,
        ``retries={"max_attempts": N}``). Raises :class:`ValueError` naming an unknown or
        twice-given option (never a value)."""
        arguments: dict[str, Any] = {}
        given: dict[str, str] = {}

        def take(name: str, value: Any, where: str) -> None:
            target = _OPTION_NAMES.get(name)
            if target is None:
                known = ", ".join(sorted({*_OPTION_NAMES, "client_kwargs", "config_kwargs"}))
                raise ValueError(f"storage_options: unknown S3 option {where!r} (known: {known})")
            if target in arguments and arguments[target] != value:
                raise ValueError(
                    f"storage_options: {given[target]!r} and {where!r} both set {target}"
                )
            arguments[target], given[target] = value, where

        for name, value in options.items():
            if name in ("client_kwargs", "config_kwargs"):
                for inner, inner_value in dict(value or {}).items():
                    if name == "config_kwargs" and inner == "retries":
                        retries = dict(inner_value or {})
                        for count in ("max_attempts", "total_max_attempts"):
                            if count in retries:
                                attempts = int(retries[count]) - (count == "total_max_attempts")
                                take("max_attempts", attempts, f"{name}.retries.{count}")
                        continue
                    take(inner, inner_value, f"{name}.{inner}")
            else:
                take(name, value, name)
        return cls(**arguments)

    def _make_client(self, retries: int, connect_timeout: float, read_timeout: float) -> Any:
        config = botocore.config.Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"total_max_attempts": retries + 1, "mode": "standard"},
            max_pool_connections=2 * self.max_concurrency + 2,
        )
        return self._session.client("s3", config=config, **self._client_options)

    def best_effort(self) -> S3Storage:
        """This storage with one attempt per request, 2 s to connect and 5 s to answer."""
        quick = copy.copy(self)
        quick._client = self._make_client(0, 2.0, 5.0)
        return quick

    def __repr__(self) -> str:  # no credentials in messages
        return f"S3Storage(endpoint_url={self._client.meta.endpoint_url!r})"

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _split(location: str) -> tuple[str, str]:
        if not location.startswith(SCHEME):
            raise ValueError(f"{location}: not an {SCHEME} location")
        parts = [p for p in location[len(SCHEME) :].split("/") if p not in ("", ".")]
        if not parts:
            raise ValueError(f"{location}: name a bucket, as in {SCHEME}BUCKET/prefix")
        return parts[0], "/".join(parts[1:])

    def _call(
        self, location: str, operation: Callable[..., _T], *, exclusive: bool = False, **kwargs: Any
    ) -> _T:
        """``operation(**kwargs)``, its client errors raised as :class:`OSError`. A server
        without conditional writes gets them unconditionally (after one warning)."""
        if not self._conditional_writes:
            kwargs.pop("IfNoneMatch", None)
        try:
            return operation(**kwargs)
        except _CLIENT_ERRORS as exc:
            if "IfNoneMatch" in kwargs and _error_code(exc) == "NotImplemented":
                _log.warning(
                    "%s: the S3 server does not support conditional writes (If-None-Match); "
                    "exclusive creates are checked before writing only, so two jobs saving "
                    "to one prefix at the same moment are not detected",
                    location,
                )
                self._conditional_writes = False
                return self._call(location, operation, exclusive=exclusive, **kwargs)
            if exclusive and _is_precondition_failure(exc):
                raise FileExistsError(errno.EEXIST, "object exists", location) from None
            raise _os_error(exc, location) from exc

    def _head(self, location: str) -> dict[str, Any]:
        bucket, key = self._split(location)
        if not key:
            raise IsADirectoryError(errno.EISDIR, "a bucket is no object", location)
        return self._call(location, self._client.head_object, Bucket=bucket, Key=key)

    def _get_object(self, location: str, **kwargs: Any) -> tuple[bytes, dict[str, Any]]:
        """The body and the response of a GET."""
        bucket, key = self._split(location)
        try:
            response = self._client.get_object(Bucket=bucket, Key=key, **kwargs)
            return response["Body"].read(), response
        except _CLIENT_ERRORS as exc:
            if "Range" in kwargs and _error_code(exc) == "InvalidRange":
                raise _EmptyObject from None  # no byte 0: the object exists and is empty
            raise _os_error(exc, location) from exc

    def _get(self, location: str, **kwargs: Any) -> bytes:
        return self._get_object(location, **kwargs)[0]

    def _put_new(self, location: str, data: bytes) -> None:
        bucket, key = self._split(location)
        self._call(
            location,
            self._client.put_object,
            exclusive=True,
            Bucket=bucket,
            Key=key,
            Body=data,
            IfNoneMatch="*",
        )

    def _keys(self, location: str, *, delimiter: bool) -> Iterator[str]:
        """Names under the prefix ``location/`` (one level with ``delimiter``), paginated."""
        bucket, key = self._split(location)
        prefix = f"{key}/" if key else ""
        paginator = self._client.get_paginator("list_objects_v2")
        extra = {"Delimiter": "/"} if delimiter else {}
        try:
            pages = paginator.paginate(
                Bucket=bucket, Prefix=prefix, PaginationConfig={"PageSize": _LIST_PAGE}, **extra
            )
            for page in pages:
                for item in page.get("CommonPrefixes", []):
                    yield item["Prefix"][len(prefix) :].rstrip("/")
                for item in page.get("Contents", []):
                    yield item["Key"][len(prefix) :]
        except _CLIENT_ERRORS as exc:
            raise _os_error(exc, location) from exc

    def _has_object(self, location: str) -> bool:
        try:
            self._head(location)
        except (FileNotFoundError, IsADirectoryError):
            return False
        return True

    # ---------------------------------------------------------------- objects
    def create(self, location: str) -> Writer:
        if self._has_object(location):
            raise FileExistsError(errno.EEXIST, "object exists", location)
        return _S3Writer(self, location)

    def open(self, location: str) -> Reader:
        return _S3Reader(self, location)

    def replace(self, location: str, data: bytes) -> None:
        bucket, key = self._split(location)
        self._call(location, self._client.put_object, Bucket=bucket, Key=key, Body=bytes(data))

    def read(self, location: str) -> bytes:
        return self._get(location)

    def size(self, location: str) -> int:
        return int(self._head(location)["ContentLength"])

    def age(self, location: str) -> float:
        return time.time() - self._head(location)["LastModified"].timestamp()

    def touch(self, location: str) -> None:
        bucket, key = self._split(location)
        self._call(
            location,
            self._client.copy_object,
            Bucket=bucket,
            Key=key,
            CopySource={"Bucket": bucket, "Key": key},
            Metadata={"touched": f"{time.time():.3f}"},
            MetadataDirective="REPLACE",
        )

    def delete(self, location: str) -> None:
        self._head(location)  # S3 deletes a missing key silently; the protocol raises
        bucket, key = self._split(location)
        self._call(location, self._client.delete_object, Bucket=bucket, Key=key)

    def copy(self, source: str, target: str) -> None:
        """A server-side copy (multipart for large objects); ``target`` must not exist."""
        if self._has_object(target):
            raise FileExistsError(errno.EEXIST, "object exists", target)
        bucket, key = self._split(source)
        target_bucket, target_key = self._split(target)
        transfer = boto3.s3.transfer.TransferConfig(
            multipart_threshold=self.part_size,
            multipart_chunksize=self.part_size,
            max_concurrency=self.max_concurrency,
        )
        self._call(
            target,
            self._client.copy,
            CopySource={"Bucket": bucket, "Key": key},
            Bucket=target_bucket,
            Key=target_key,
            Config=transfer,
        )

    # --------------------------------------------------------------- prefixes
    def is_dir(self, location: str) -> bool:
        bucket, key = self._split(location)
        prefix = f"{key}/" if key else ""
        response = self._call(
            location, self._client.list_objects_v2, Bucket=bucket, Prefix=prefix, MaxKeys=1
        )
        return bool(response.get("KeyCount", 0))

    def exists(self, location: str) -> bool:
        return self._has_object(location) or self.is_dir(location)

    def list(self, location: str) -> list[str]:
        names = sorted(set(self._keys(location, delimiter=True)))
        if not names:
            raise FileNotFoundError(errno.ENOENT, "no such prefix", location)
        return names

    def walk(self, location: str) -> list[str]:
        return sorted(self._keys(location, delimiter=False))

    def make_dirs(self, location: str) -> None:
        self._split(location)  # prefixes need not be made; the location must be valid

    def delete_tree(self, location: str) -> None:
        bucket, key = self._split(location)
        keys = [f"{key}/{name}" if key else name for name in self._keys(location, delimiter=False)]
        if key and self._has_object(location):
            keys.append(key)
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": k} for k in keys[start : start + _DELETE_BATCH]]
            response = self._call(
                location,
                self._client.delete_objects,
                Bucket=bucket,
                Delete={"Objects": batch, "Quiet": True},
            )
            failed = response.get("Errors", [])
            if failed:
                first = failed[0]
                raise OSError(
                    errno.EIO,
                    f"{len(failed)} objects not deleted, e.g. {first.get('Key')}: "
                    f"{first.get('Code')} {first.get('Message', '')}",
                    location,
                )

    def rename(self, source: str, target: str) -> None:
        """Copy then delete, object by object: not atomic (the commit never relies on it)."""
        if self._has_object(source):
            bucket, key = self._split(target)
            self._call(
                target,
                self._client.copy_object,
                Bucket=bucket,
                Key=key,
                CopySource=dict(zip(("Bucket", "Key"), self._split(source), strict=True)),
            )
            self.delete(source)
            return
        names = self.walk(source)
        if not names:
            raise FileNotFoundError(errno.ENOENT, "no such object or prefix", source)
        if self.exists(target):
            raise FileExistsError(errno.EEXIST, "target exists", target)
        for name in names:
            self.copy(f"{source}/{name}", f"{target}/{name}")
        self.delete_tree(source)

    # ---------------------------------------------------------------- the rest
    def parent(self, location: str) -> str:
        bucket, key = self._split(location)
        head = key.rpartition("/")[0]
        return f"{SCHEME}{bucket}/{head}" if head else f"{SCHEME}{bucket}"

    def free_bytes(self, location: str) -> int | None:
        return None


_default: S3Storage | None = None
_default_lock = threading.Lock()


def default_storage(url: str) -> S3Storage:
    """The storage for ``s3://`` URLs not under a :func:`~ddpckpt.storage.mount`: one per
    process, configured from the environment and AWS config files."""
    global _default
    with _default_lock:
        if _default is None:
            _default = S3Storage()
            _log.debug("s3:// served by %r", _default)
        return _default


def reset_default() -> None:
    """Forget the default storage, so the next ``s3://`` URL reads the environment anew."""
    global _default
    with _default_lock:
        _default = None
