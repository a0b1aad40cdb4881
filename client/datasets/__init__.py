"""Datasets: `vllm-tap record`'s recorder, the stored format's readers and the exports for training tools.

    reader         open_dataset, activation_batches: read what the recorder committed (numpy, pyarrow)
    recorder       the watch stream to rolling Parquet / Arrow IPC shards, exactly once (the I/O side)
    recorder_core  the recorder's commit protocol, without I/O
    store          where a dataset lives: a directory or any fsspec URL
    export         SAELens and distillation layouts of a recorded dataset

Everything here is on the client side of the layers: the core (vllm_tap.dataset_format) and the
subscribing client, never torch or vLLM (torch only when a reader is asked for tensors).
"""

from .reader import DatasetError, TapDataset, activation_batches, open_dataset

__all__ = ["DatasetError", "TapDataset", "activation_batches", "open_dataset"]
