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


class CorpusError(Exception):
    """A run that cannot go on; the message names the input line, the flag or the output at fault."""
