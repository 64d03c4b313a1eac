"""TensorBoard event files, when logging.tensorboard=true: one scalar per metric per logged step
in {run dir}/tensorboard/, so `tensorboard --logdir outputs` finds every run, plus the run's
resolved config once as text. Written with the `tensorboard` package's own event writer (no
TensorFlow, torch or tensorboardX), imported only then; flushed at every logged step, so a killed
run keeps the events it logged."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import ClassVar

SUBDIR = "tensorboard"  # {run dir}/tensorboard: one TensorBoard "run" per training run


@dataclass(frozen=True)
class TensorBoard:
    name: ClassVar[str] = "tensorboard"
    tensorboard: bool = False  # event files in {run dir}/tensorboard: tensorboard --logdir outputs

    def build(self, run_dir: str, total_steps: int, start_step: int, config: dict,
              saved: dict | None = None) -> "TensorBoardSink | None":
        if not self.tensorboard:
            return None
        return TensorBoardSink(os.path.join(run_dir, SUBDIR), start_step, config)


def config_text(config: dict) -> str:
    """The resolved config as Markdown TensorBoard's text tab shows verbatim (a code block)."""
    plain = {k: v for k, v in config.items() if k != "hydra"}
    body = json.dumps(plain, indent=2, sort_keys=False, default=str)
    return "\n".join("    " + line for line in body.splitlines())


class TensorBoardSink:
    def __init__(self, logdir: str, start_step: int, config: dict | None):
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        # Each segment of a run (fresh or resumed) opens its own events file in the same folder.
        self._writer = EventFileWriter(logdir)
        if start_step > 0:
            # A resumed run restarts from its checkpoint (start_step steps done): what the previous
            # segment logged after it is stale and is logged again. SessionLog START at step s
            # tells TensorBoard's reader to drop earlier files' events from step s on (what torch's
            # SummaryWriter(purge_step=s) writes).
            self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=start_step + 1,
                                                   session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
        if config:
            self._add_text("config", config_text(config), start_step)
        self._writer.flush()

    def _add_text(self, tag: str, text: str, step: int) -> None:
        from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2, types_pb2
        from tensorboard.plugins.text.metadata import create_summary_metadata

        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[text.encode()],
                                        tensor_shape=tensor_shape_pb2.TensorShapeProto())
        value = self._summary_pb2.Summary.Value(tag=tag, tensor=tensor,
                                                metadata=create_summary_metadata(display_name=tag, description=""))
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=step,
                                                     summary=self._summary_pb2.Summary(value=[value])))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        # One event per logged step holding every metric (plain floats, as metrics.jsonl gets
        # them); a NaN loss is written as is: TensorBoard shows it, and it is what happened.
        values = [self._summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in metrics.items()
                  if not isinstance(v, str)]  # data/fingerprint: in metrics.jsonl and the console header
        self._writer.add_event(self._event_pb2.Event(wall_time=time.time(), step=int(step),
                                                     summary=self._summary_pb2.Summary(value=values)))
        self._writer.flush()

    def log_samples(self, step: int, samples: list[tuple[str, str]]) -> None:
        for i, (prompt, text) in enumerate(samples):
            self._add_text(f"samples/{i}", f"prompt: {prompt!r}\n\n    " + text.replace("\n", "\n    "), int(step))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

