"""Run by tests/e2e/test_server_reducers.py inside the sae-lens virtualenv (.venv-sae).

    train ACTS.npy OUT_DIR ARCH   a tiny SAE (ARCH standard or topk) trained by SAELens for a few steps on
                                  the rows of ACTS.npy [n, d_in] float32, saved as SAELens saves an SAE
                                  for inference (cfg.json + sae_weights.safetensors), then loaded back by
                                  SAELens; prints one JSON line (losses, the cfg)
    encode SAE_DIR X.npy OUT.npy  the SAE loaded from disk by SAELens; OUT.npy = its encode(X), float32
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch


def train(acts_path: str, out: str, arch: str) -> None:
    from sae_lens import SAE, SAETrainer, StandardTrainingSAE, StandardTrainingSAEConfig, TopKTrainingSAE, \
        TopKTrainingSAEConfig
    from sae_lens.config import LoggingConfig, SAETrainerConfig

    acts = torch.from_numpy(np.load(acts_path))
    d_in, batch, steps = acts.shape[1], 32, 40
    torch.manual_seed(0)
    if arch == "topk":
        sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=d_in, d_sae=4 * d_in, k=8))
    else:
        sae = StandardTrainingSAE(StandardTrainingSAEConfig(d_in=d_in, d_sae=4 * d_in, l1_coefficient=1e-3))

    def provider():
        g = torch.Generator().manual_seed(1)
        while True:
            yield acts[torch.randint(0, len(acts), (batch,), generator=g)]

    cfg = SAETrainerConfig(total_training_samples=steps * batch, train_batch_size_samples=batch, lr=3e-3,
                           lr_end=3e-3, device="cpu", logger=LoggingConfig(log_to_wandb=False),
                           n_batches_for_norm_estimate=2)
    losses: list[float] = []
    trainer = SAETrainer(cfg=cfg, sae=sae, data_provider=provider())
    step = trainer.step

    def record_step(batch_acts):
        result = step(batch_acts)
        losses.append(float(result.loss))
        return result

    trainer.step = record_step  # type: ignore[method-assign]
    trained = trainer.fit()
    trained.save_inference_model(out)
    loaded = SAE.load_from_disk(out)
    with open(f"{out}/cfg.json") as f:
        print(json.dumps({"losses": losses, "cfg": json.load(f), "class": type(loaded).__name__}))


def encode(sae_dir: str, x_path: str, out_path: str) -> None:
    from sae_lens import SAE

    sae = SAE.load_from_disk(sae_dir)
    with torch.no_grad():
        acts = sae.encode(torch.from_numpy(np.load(x_path)))
    np.save(out_path, acts.float().numpy())


if __name__ == "__main__":
    {"train": train, "encode": encode}[sys.argv[1]](*sys.argv[2:])
