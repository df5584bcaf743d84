"""Embedding a corpus: ``python -m kembed.client embed`` (the CLI is in :mod:`kembed.client`).

Texts come from a file or stdin (:mod:`.inputs`), go to the server in batches over one
``EmbedStream`` with a bounded window of work (:mod:`.stream`), and their rows are written in input
order to ``.npy``, JSONL or Parquet (:mod:`.outputs`). :mod:`.job` ties them together.

Resuming needs no record of its own: the output is the record. Rows are appended in input order
and committed in chunks (fsynced, then counted: the ``.npy`` header's shape, JSONL's complete
lines, Parquet's staging ``.npy``), so a run that stopped, for any reason, left an output whose
committed rows are the input's first rows; the same command run again skips that many texts.
"""


class BulkError(Exception):
    """A job that cannot go on; the message names the input line, the flag or the output at fault."""
