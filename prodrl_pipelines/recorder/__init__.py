"""The recorder: an OpenAI-compatible recording proxy with a write-ahead log (DESIGN.md s.7).

``service`` (HTTP: proxying, stripping, feedback, auth, counters), ``ingest`` (exactly-once storage:
WAL, group commit, flush to Parquet parts, replay on start) and ``wal`` (the log's segment format).
"""

from prodrl_pipelines.recorder.ingest import Ingestor, Stats
from prodrl_pipelines.recorder.service import RecorderConfig, build_recorder_app
from prodrl_pipelines.recorder.wal import WriteAheadLog

__all__ = ["Ingestor", "Stats", "RecorderConfig", "build_recorder_app", "WriteAheadLog"]
