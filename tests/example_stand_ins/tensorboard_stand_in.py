"""``torch.utils.tensorboard`` for the tests: a ``SummaryWriter`` that appends each scalar to
``LOG_DIR/scalars.jsonl`` as ``{"tag", "value", "step"}``."""
import json
import os


class SummaryWriter:
    def __init__(self, log_dir=None, **kwargs):
        self.log_dir = log_dir or "runs"
        os.makedirs(self.log_dir, exist_ok=True)
        self._file = open(os.path.join(self.log_dir, "scalars.jsonl"), "a")

    def add_scalar(self, tag, scalar_value, global_step=None, walltime=None, **kwargs):
        self._file.write(json.dumps({"tag": tag, "value": float(scalar_value),
                                     "step": global_step}) + "\n")
        self._file.flush()

    def flush(self):
        self._file.flush()

    def close(self):
        self._file.close()
