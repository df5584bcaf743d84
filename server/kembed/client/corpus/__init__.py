"""The corpus command: ``python -m kembed.client embed`` (docs/client.md).

Texts come from a file or stdin (:mod:`.reader`), go to the server in spans of consecutive texts
over one ``EmbedStream`` with a bounded window of work (:mod:`.stream`), and their rows are written
in input order to ``.npy``, JSONL or Parquet (:mod:`.writers`). :mod:`.run` ties them together;
:mod:`.command` is the CLI.

Resuming needs no record of its own: the output is the record. Rows are appended in input order
and committed in chunks (fsynced, then counted: the ``.npy`` header's shape, JSONL's complete
lines, Parquet's staging ``.npy``), so a run that stopped, for any reason, left an output whose
committed rows are the input's first rows; the same command run again skips that many texts.
"""

from __future__ import annotations

import errno

# What running the same command again cannot change, by errno, and what to do instead.
FINAL_ERRNOS = {
    errno.EROFS: "a read-only file system: write the output where this run may write",
    errno.EACCES: "this run may not use it: give it the permission, or another path",
    errno.EPERM: "this run may not use it: give it the permission, or another path",
    errno.ENOENT: "check the path (an output's folder must exist)",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EISDIR: "name a file, not a folder",
    errno.EFBIG: "the file cannot grow any larger here: write to another file system, or in shards (--shard)",
    errno.ENAMETOOLONG: "use a shorter path",
    errno.ELOOP: "the path's symbolic links loop",
}
# A full disk or quota: freed, the same command goes on from the rows committed.
SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class CorpusError(Exception):
    """A run that cannot go on; the message names the input line, the flag or the output at fault.
    Running the same command again may succeed (the server was away, space was freed)."""


class FinalError(CorpusError):
    """A run that cannot succeed as it is, however often it runs: its input, a flag or its output
    must change first (a bad line, dimensions the model lacks, a read-only output)."""


def file_error(flag: str, path: object, error: OSError, rows: int | None = None) -> CorpusError:
    """An OSError on the input or the output as one line: the flag, the file, what happened and
    what to do (``rows``: how many the output holds committed); final unless freeing space or
    another try can help."""
    where = f"{flag}: {error.filename or path}: {error.strerror or error}"
    if error.errno in FINAL_ERRNOS:
        return FinalError(f"{where}; {FINAL_ERRNOS[error.errno]} (running it again cannot help)")
    kept = "the rows committed are kept" if rows is None else f"the {rows} rows committed are kept"
    if error.errno in SPACE_ERRNOS:
        return CorpusError(f"{where}; {kept}: free space, then run the same command again to go on from them")
    return CorpusError(f"{where}; {kept}: run the same command again to go on from them")
