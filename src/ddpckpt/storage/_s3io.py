"""Streams of one S3 object: :class:`S3Writer` uploads (multipart past a part size, parts
in parallel, aborted on failure so no partial object is ever visible), :class:`S3Reader`
downloads (a small object at once, a large one by parallel ranged GETs of the version that
was opened). Used by :class:`~ddpckpt.storage.s3.S3Storage`, whose pool and sizes they use.
"""

from __future__ import annotations

import contextlib
import errno
from concurrent.futures import Executor, Future
from typing import Any, Protocol

from ddpckpt._log import get_logger
from ddpckpt.storage._s3client import CLIENT_ERRORS, EmptyObject, S3Requests, os_error, split
from ddpckpt.storage._streams import RangedReader, Writer

_log = get_logger(__name__)
_PARTS_PER_SIZE = 1000


class S3Transfers(Protocol):
    """What the streams use of their :class:`~ddpckpt.storage.s3.S3Storage`: its requests,
    thread pool and sizes."""

    part_size: int
    max_concurrency: int
    small_object: int
    _requests: S3Requests

    @property
    def _pool(self) -> Executor: ...  # read only here: S3Storage's is a ThreadPoolExecutor


class S3Writer(Writer):
    """Buffers writes; past ``part_size`` bytes it becomes a multipart upload whose parts
    go out concurrently as they fill. ``sync`` completes the upload; ``close`` without
    ``sync`` (or any failure) aborts it, so no partial object is ever visible."""

    def __init__(self, store: S3Transfers, location: str) -> None:
        self._store, self._location = store, location
        self._bucket, self._key = split(location)
        self._buffer: bytearray | None = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._done = False

    def write(self, data: Any) -> None:
        if self._buffer is None:
            raise ValueError(f"{self._location}: write after close")
        self._buffer += memoryview(data).cast("B")
        while len(self._buffer) >= (size := self._part_bytes()):
            part = bytes(self._buffer[:size])
            del self._buffer[:size]
            self._send_part(part)

    def _part_bytes(self) -> int:
        """The size of the next part: ``part_size``, doubled every 1000 parts, so that S3's
        10,000 parts reach terabytes while a checkpoint's usual objects go up in small
        parts (whose uploads start early and end soon after the last byte is written)."""
        return self._store.part_size << (len(self._parts) // _PARTS_PER_SIZE)

    def _send_part(self, part: bytes) -> None:
        store = self._store
        try:
            if self._upload_id is None:
                self._upload_id = store._requests.call(
                    self._location,
                    store._requests.client.create_multipart_upload,
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
        response = self._store._requests.call(
            self._location,
            self._store._requests.client.upload_part,
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
                store._requests.put_new(self._location, bytes(self._buffer))
            else:
                if self._buffer:
                    self._send_part(bytes(self._buffer))
                parts = [f.result() for f in self._parts]
                store._requests.call(
                    self._location,
                    store._requests.client.complete_multipart_upload,
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
            self._store._requests.client.abort_multipart_upload(
                Bucket=self._bucket, Key=self._key, UploadId=upload_id
            )
        except CLIENT_ERRORS as exc:
            _log.warning(
                "%s: could not abort an unfinished multipart upload (%s); a bucket lifecycle "
                "rule for incomplete uploads removes its parts",
                self._location,
                os_error(exc, self._location),
            )

    def close(self) -> None:
        if self._buffer is None:
            return
        if not self._done:
            self._abort()
        self._buffer = None


class S3Reader(RangedReader):
    """A small object is downloaded when opened; a larger one is read by ranged GETs of
    the version that was opened, in parallel for long reads."""

    def __init__(self, store: S3Transfers, location: str) -> None:
        self._store, self._location = store, location
        self._data: bytes | None = None
        self._prefix = b""
        # One request tells the size and version and, for a small object, brings it all.
        try:
            data, response = store._requests.get_object(
                location, Range=f"bytes=0-{store.small_object - 1}"
            )
        except EmptyObject:
            self.size, self._etag, self._data = 0, "", b""
            return
        total = str(response.get("ContentRange", "")).rpartition("/")[2]
        self.size = int(total) if total.isdigit() else len(data)
        self._etag = response["ETag"]
        if len(data) == self.size:
            self._data = data
        else:
            self._prefix = data  # the object's first bytes, read anyway: not read again

    def _get_range(self, view: memoryview, offset: int) -> None:
        data = self._store._requests.get(
            self._location,
            Range=f"bytes={offset}-{offset + len(view) - 1}",
            IfMatch=self._etag,
        )
        if len(data) != len(view):
            raise OSError(
                errno.EIO, f"short ranged read ({len(data)} of {len(view)} bytes)", self._location
            )
        view[:] = data

    def _read_range(self, view: memoryview, offset: int) -> None:
        known = max(0, min(len(view), len(self._prefix) - offset))
        view[:known] = self._prefix[offset : offset + known]
        view, offset = view[known:], offset + known
        chunk, count = self._store.part_size, len(view)
        futures = [
            self._store._pool.submit(
                self._get_range, view[start : min(start + chunk, count)], offset + start
            )
            for start in range(0, count, chunk)
        ]
        for future in futures:
            future.result()

    def close(self) -> None:
        super().close()
        self._prefix = b""
