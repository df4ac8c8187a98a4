"""S3-compatible object storage: ``s3://bucket/prefix`` (extra ``ddpckpt[s3]``).

A checkpoint commits with :class:`~ddpckpt.storage._commit.ManifestLastCommit`: every rank
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
it keeps those bytes; a larger one keeps its first ``small_object`` bytes and reads the rest
by ranges of the version it opened (``If-Match``), raising :class:`OSError` if that object
is replaced meanwhile. ``rename`` and
``delete_tree`` copy/delete object by object and are not atomic (the commit never relies
on them). ``age`` compares the server's clock with this machine's.
"""

from __future__ import annotations

import builtins
import copy
import errno
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ddpckpt._log import get_logger
from ddpckpt.storage._base import Storage
from ddpckpt.storage._commit import ManifestLastCommit
from ddpckpt.storage._names import plain_name
from ddpckpt.storage._s3client import (
    CLIENT_ERRORS,
    SCHEME,
    S3Requests,
    TransferConfig,
    os_error,
    settings,
    split,
)
from ddpckpt.storage._s3io import S3Reader, S3Writer
from ddpckpt.storage._streams import Reader, Writer

__all__ = ["SCHEME", "S3Storage", "default_storage", "reset_default"]

_MiB = 1 << 20
_DELETE_BATCH = 1000  # the most keys one DeleteObjects request takes
_LIST_PAGE = 1000  # keys per ListObjectsV2 page (the server's maximum)
_log = get_logger(__name__)


class S3Storage(Storage):
    """``s3://bucket/key`` locations on one S3 endpoint (any bucket).

    Arguments left ``None`` come from boto3's usual places: ``AWS_ENDPOINT_URL``,
    ``AWS_REGION``, the credential variables, ``~/.aws/config``/``credentials``, instance
    roles. Every request times out (``connect_timeout``, ``read_timeout`` seconds) and is
    retried at most ``max_attempts`` times with backoff. Objects over ``part_size`` bytes
    are uploaded in parts (``part_size``, doubled every 1000 parts), ``max_concurrency`` at
    a time; reads over ``part_size`` go out as that many parallel ranged GETs. 8 MiB parts
    (boto3's own default) saved a 64 MiB checkpoint twice as fast as 32 MiB ones against a
    local server: the last part's upload, after the last byte is written, is shorter.
    Credentials are never logged.

    Configure it with ``storage_options=`` (:meth:`from_options`) to ``save``, ``load`` or
    ``Checkpointer`` (the Object storage page of the documentation shows it). One instance serves all the threads of a
    process; each process makes its own.

    Args:
        endpoint_url: The S3 endpoint (a MinIO or other S3-compatible server's URL).
        region_name: The region.
        aws_access_key_id: The access key.
        aws_secret_access_key: The secret key.
        aws_session_token: A session token for temporary credentials.
        profile_name: A profile of the AWS config files.
        connect_timeout: Seconds to wait for a connection.
        read_timeout: Seconds to wait for a response's bytes.
        max_attempts: How many times a request is tried in all.
        part_size: Bytes per part of a multipart upload, and the size above which reads
            are split into parallel ranged GETs.
        max_concurrency: Parts uploaded, or ranges read, at once per object.
        small_object: Objects up to this size are downloaded whole when opened.

    Raises:
        ValueError: ``part_size`` is under 5 MiB (S3's least part).
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
        part_size: int = 8 * _MiB,
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
        self._requests = S3Requests(
            endpoint_url=endpoint_url,
            region_name=region_name,
            aws_access_key_id=aws_access_key_id,
            aws_secret_access_key=aws_secret_access_key,
            aws_session_token=aws_session_token,
            profile_name=profile_name,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_attempts=max_attempts,
            connections=2 * max_concurrency + 2,
        )
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="ddpckpt-s3")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> S3Storage:
        """A storage made from a ``storage_options`` mapping (what
        ``storage_options=`` of ``save``, ``load`` and ``Checkpointer`` makes); local.

        Args:
            options: In this class's argument names or in those s3fs/fsspec users pass:
                ``key``/``secret``/``token``, ``profile``, ``region``, ``client_kwargs``
                (``endpoint_url``, ``region_name``, credentials) and ``config_kwargs``
                (``connect_timeout``, ``read_timeout``, ``retries={"max_attempts": N}``).

        Returns:
            The storage.

        Raises:
            ValueError: An unknown or twice-given option (named, never its value).
        """
        return cls(**settings(options))

    @property
    def _client(self) -> Any:
        """The boto3 client (for what this class does not wrap)."""
        return self._requests.client

    def best_effort(self) -> S3Storage:
        """This storage with one attempt per request, 2 s to connect and 5 s to answer."""
        quick = copy.copy(self)
        quick._requests = self._requests.best_effort()
        return quick

    def __repr__(self) -> str:  # no credentials in messages
        return f"S3Storage(endpoint_url={self._requests.endpoint!r})"

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _split(location: str) -> tuple[str, str]:
        return split(location)

    def _listing(self, location: str, *, delimiter: bool) -> Iterator[str | None]:
        """Each name under the prefix ``location/`` (one level with ``delimiter``), page by
        page as listed; ``None`` for a key (or, with ``delimiter``, a prefix standing for
        the keys under it) whose name has an empty, ``.`` or ``..`` segment, skipped with a
        WARNING (:mod:`~ddpckpt.storage._names`): every name given is a key (or prefix)
        exactly as listed, never re-split into another."""
        bucket, key = split(location)
        prefix = f"{key}/" if key else ""
        paginator = self._client.get_paginator("list_objects_v2")
        extra = {"Delimiter": "/"} if delimiter else {}
        try:
            pages = paginator.paginate(
                Bucket=bucket, Prefix=prefix, PaginationConfig={"PageSize": _LIST_PAGE}, **extra
            )
            for page in pages:
                listed = (
                    [
                        (item["Prefix"], item["Prefix"][len(prefix) : -1], True)  # less its "/"
                        for item in page.get("CommonPrefixes", [])
                    ]
                    + [
                        (item["Key"], item["Key"][len(prefix) :], False)
                        for item in page.get("Contents", [])
                        if item["Key"] != prefix  # a console's "folder" marker: the prefix itself
                    ]
                )
                for full, name, is_prefix in listed:
                    yield plain_name(name, full, location, bucket=bucket, prefix=is_prefix)
        except CLIENT_ERRORS as exc:
            raise os_error(exc, location) from exc

    def _keys(self, location: str, *, delimiter: bool) -> tuple[list[str], bool]:
        """The names :meth:`_listing` gives, and whether anything at all lies there."""
        listed = list(self._listing(location, delimiter=delimiter))
        return [name for name in listed if name is not None], bool(listed)

    def _has_object(self, location: str) -> bool:
        try:
            self._requests.head(location)
        except (FileNotFoundError, IsADirectoryError):
            return False
        return True

    # ---------------------------------------------------------------- objects
    def create(self, location: str) -> Writer:
        if self._has_object(location):
            raise FileExistsError(errno.EEXIST, "object exists", location)
        return S3Writer(self, location)

    def open(self, location: str) -> Reader:
        return S3Reader(self, location)

    def replace(self, location: str, data: bytes) -> None:
        bucket, key = split(location)
        self._requests.call(
            location, self._requests.client.put_object, Bucket=bucket, Key=key, Body=bytes(data)
        )

    def read(self, location: str) -> bytes:
        return self._requests.get(location)

    def size(self, location: str) -> int:
        return int(self._requests.head(location)["ContentLength"])

    def age(self, location: str) -> float:
        return time.time() - self._requests.head(location)["LastModified"].timestamp()

    def touch(self, location: str) -> None:
        bucket, key = split(location)
        self._requests.call(
            location,
            self._requests.client.copy_object,
            Bucket=bucket,
            Key=key,
            CopySource={"Bucket": bucket, "Key": key},
            Metadata={"touched": f"{time.time():.3f}"},
            MetadataDirective="REPLACE",
        )

    def delete(self, location: str) -> None:
        self._requests.head(location)  # S3 deletes a missing key silently; the protocol raises
        bucket, key = split(location)
        self._requests.call(location, self._requests.client.delete_object, Bucket=bucket, Key=key)

    def copy(self, source: str, target: str) -> None:
        """A server-side copy (multipart for large objects); ``target`` must not exist."""
        if self._has_object(target):
            raise FileExistsError(errno.EEXIST, "object exists", target)
        bucket, key = split(source)
        target_bucket, target_key = split(target)
        transfer = TransferConfig(
            multipart_threshold=self.part_size,
            multipart_chunksize=self.part_size,
            max_concurrency=self.max_concurrency,
        )
        self._requests.call(
            target,
            self._requests.client.copy,
            CopySource={"Bucket": bucket, "Key": key},
            Bucket=target_bucket,
            Key=target_key,
            Config=transfer,
        )

    # --------------------------------------------------------------- prefixes
    def is_dir(self, location: str) -> bool:
        """Whether a name ddpckpt could use lies under ``location/`` (a prefix holding only
        skipped keys is none: nothing there can be read, moved or deleted by name)."""
        return any(name is not None for name in self._listing(location, delimiter=True))

    def exists(self, location: str) -> bool:
        return self._has_object(location) or self.is_dir(location)

    def list(self, location: str) -> list[str]:
        names, found = self._keys(location, delimiter=True)
        if not found:
            raise FileNotFoundError(errno.ENOENT, "no such prefix", location)
        return sorted(set(names))  # empty where all it holds was skipped (and reported)

    def walk(self, location: str) -> builtins.list[str]:
        return sorted(self._keys(location, delimiter=False)[0])

    def make_dirs(self, location: str) -> None:
        split(location)  # prefixes need not be made; the location must be valid

    def delete_tree(self, location: str) -> None:
        bucket, key = split(location)
        names = self._keys(location, delimiter=False)[0]
        keys = [f"{key}/{name}" if key else name for name in names]
        if key and self._has_object(location):
            keys.append(key)
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": k} for k in keys[start : start + _DELETE_BATCH]]
            response = self._requests.call(
                location,
                self._requests.client.delete_objects,
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
            bucket, key = split(target)
            self._requests.call(
                target,
                self._requests.client.copy_object,
                Bucket=bucket,
                Key=key,
                CopySource=dict(zip(("Bucket", "Key"), split(source), strict=True)),
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
        bucket, key = split(location)
        head = key.rpartition("/")[0]
        return f"{SCHEME}{bucket}/{head}" if head else f"{SCHEME}{bucket}"

    def free_bytes(self, location: str) -> int | None:
        return None


_default: S3Storage | None = None
_default_lock = threading.Lock()


def default_storage(url: str) -> S3Storage:
    """The storage for ``s3://`` URLs not configured with ``storage_options=``: one per
    process, configured from the environment and AWS config files, made on first use;
    local and thread-safe (the ``s3`` scheme's factory).

    Args:
        url: The URL being resolved (any bucket: the one storage serves them all).

    Returns:
        The process's default :class:`S3Storage`.
    """
    global _default
    with _default_lock:
        if _default is None:
            _default = S3Storage()
            _log.debug("s3:// served by %r", _default)
        return _default


def reset_default() -> None:
    """Forget the default storage, so the next ``s3://`` URL reads the environment anew;
    local (this process only). Storages mounted or configured stay, and so does the storage
    of a ``Checkpointer`` made before (it resolves its directory once, when it is made)."""
    global _default
    with _default_lock:
        _default = None
