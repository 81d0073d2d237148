"""mxhylo.io: pipelined, rank-aware input for Gluon training loops.

- :class:`RecordLoader` (record_loader.py): ImageRecordIter batches prepared on a
  background thread, split and copied onto each context, sharded by kvstore rank.
- batches.py: trim/pad, split, cast and copy of one batch; pipeline.py: the bounded
  background queue; recfile.py: .rec/.idx checks and record diagnostics;
  packing.py / digits_sample.py: what ``python -m mxhylo.im2rec`` runs.
"""
from .batches import Batch
from .recfile import RecordDecodeError, RecordFileError, check_record_files
from .record_loader import RecordLoader

__all__ = ["RecordLoader", "Batch", "RecordFileError", "RecordDecodeError", "check_record_files"]
