"""examples/pretrain.py with a planted fault, rehearsed by test_rehearse.py: `faulty_pretrain.py FAULT ARGS...`

- same-samples: the train DataLoader is built by hand and never prepared by accelerate, so every rank
  reads every sample in the same order (a classic custom-loader bug);
- tp-split-rows: under AutoTP, a hand-built loader sharded over every rank (DistributedSampler with the world
  size), so the ranks of a TP group, which must train the same batch, get different rows;
- no-data-resume: the script turns batch skipping off (ignore_data_skip), so a resumed run starts its
  epoch over instead of continuing where the checkpoint stopped.
"""

import sys
from pathlib import Path

from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import pretrain  # noqa: E402

from hf_pretrain import PretrainTrainer  # noqa: E402


class SameSamples(PretrainTrainer):
    def get_train_dataloader(self):
        data = self._remove_unused_columns(self.train_dataset, description="training")
        sampler = self._get_train_sampler(data)
        batch = self.args.per_device_train_batch_size
        return DataLoader(data, batch_size=batch, sampler=sampler, collate_fn=self.data_collator)


class SplitRows(PretrainTrainer):
    def get_train_dataloader(self):
        data = self._remove_unused_columns(self.train_dataset, description="training")
        sampler = DistributedSampler(data, self.args.world_size, self.args.process_index, shuffle=False)
        batch = self.args.per_device_train_batch_size
        return DataLoader(data, batch_size=batch, sampler=sampler, collate_fn=self.data_collator, drop_last=True)


if __name__ == "__main__":
    fault, argv = sys.argv[1], sys.argv[2:]
    if fault == "same-samples":
        pretrain.PretrainTrainer = SameSamples
    elif fault == "tp-split-rows":
        pretrain.PretrainTrainer = SplitRows
    elif fault == "no-data-resume":
        argv += ["--ignore_data_skip", "true"]
    else:
        raise SystemExit(f"unknown fault {fault!r}: same-samples, tp-split-rows or no-data-resume")
    pretrain.main(argv)
