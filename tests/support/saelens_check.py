"""Run by tests/datasets/test_datasets.py inside the sae-lens virtualenv (.venv-sae): SAELens's own loader
reads a `vllm-tap export saelens` directory, and a small SAE trains a few steps on it, then a few
more with vllm-tap's shuffled iterator as the data provider. Prints one JSON line of results.

    .venv-sae/bin/python tests/support/saelens_check.py EXPORT_DIR HOOK D_IN CONTEXT EXPECTED.npy DATASET_DIR
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch


def train(data_provider, d_in: int, steps: int, batch: int) -> list[float]:
    from sae_lens import SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig
    from sae_lens.config import LoggingConfig, SAETrainerConfig

    torch.manual_seed(0)
    sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=d_in, d_sae=4 * d_in, l1_coefficient=1e-3))
    cfg = SAETrainerConfig(total_training_samples=steps * batch, train_batch_size_samples=batch, lr=3e-3,
                           lr_end=3e-3, device="cpu", logger=LoggingConfig(log_to_wandb=False),
                           n_batches_for_norm_estimate=2)
    losses: list[float] = []
    trainer = SAETrainer(cfg=cfg, sae=sae, data_provider=data_provider)
    step = trainer.step

    def record_step(batch_acts):
        out = step(batch_acts)
        losses.append(float(out.loss))
        return out

    trainer.step = record_step  # type: ignore[method-assign]
    trainer.fit()
    return losses


def main() -> None:
    export_dir, hook, d_in, context, expected_path, dataset_dir = sys.argv[1:7]
    d_in, context = int(d_in), int(context)
    from sae_lens.training.activations_store import ActivationsStore

    store = ActivationsStore(
        model=None, dataset=None, streaming=False, hook_name=hook, hook_head_index=None, context_size=context,
        d_in=d_in, n_batches_in_buffer=2, total_training_tokens=10**6, store_batch_size_prompts=2,
        train_batch_size_tokens=16, prepend_bos=False, normalize_activations="none", device=torch.device("cpu"),
        dtype="float32", cached_activations_path=export_dir,
    )
    rows = store.cached_activation_dataset[:]  # formatted as torch by SAELens's loader
    loaded = rows[hook].numpy()
    tokens = rows["token_ids"].numpy()
    expected = np.load(expected_path)
    acts_equal = bool(loaded.shape == expected["acts"].shape and np.array_equal(loaded, expected["acts"]))
    tokens_equal = bool(tokens.shape == expected["tokens"].shape and np.array_equal(tokens, expected["tokens"]))
    raw_batch, raw_tokens = store.get_raw_llm_batch()
    losses_store = train(store, d_in, steps=30, batch=16)

    from vllm_tap.client.datasets import activation_batches

    provider = activation_batches(dataset_dir, hook, 16, shuffle_buffer=64, epochs=None, torch=True)
    losses_iter = train(provider, d_in, steps=30, batch=16)
    print(json.dumps({
        "acts_equal": acts_equal, "tokens_equal": tokens_equal, "shape": list(loaded.shape),
        "raw_batch_shape": list(raw_batch.shape), "raw_tokens": raw_tokens is not None,
        "losses_store": losses_store, "losses_iter": losses_iter,
    }))


if __name__ == "__main__":
    main()
