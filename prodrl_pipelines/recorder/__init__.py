"""The recorder: an OpenAI-compatible recording proxy with a write-ahead log (DESIGN.md s.7).

``service`` (the config and the ``Recorder``: forcing the recording fields, building rows, the upstream
client), ``requests`` (what a client asked for, what cannot be recorded), ``answers`` (what the client
gets back, streamed answers accumulated), ``calls`` (reading one call: body, ids, retry identity,
errors), ``streaming`` (a streamed call), ``responses`` (the Responses API over chat completions),
``tenants`` (bearer tokens -> tenants, rate limits), ``http`` (routes, feedback, auth, counters, the app),
``cli`` (``prodrl record``), ``ingest`` (exactly-once storage: WAL, group commit, flush to Parquet
parts, replay on start) and ``wal`` (the log's segment format).
"""

from prodrl_pipelines.recorder.http import build_recorder_app
from prodrl_pipelines.recorder.counters import Stats
from prodrl_pipelines.recorder.ingest import Ingestor
from prodrl_pipelines.recorder.service import RecorderConfig
from prodrl_pipelines.recorder.wal import WriteAheadLog

__all__ = ["Ingestor", "Stats", "RecorderConfig", "build_recorder_app", "WriteAheadLog"]
