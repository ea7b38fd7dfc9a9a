"""The training script ``python -m bench endings`` launches under ``torchrun``: as a user writes one, it sets up
through an ``Accelerator``, runs one sharded training step of a saved model, and ends ``--ending`` way."""
import argparse

import torch
import torch.distributed as dist
from accelerate import Accelerator
from transformers import AutoModelForCausalLM

import hf_ring


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a saved model directory")
    parser.add_argument("--ending", required=True, choices=("destroy", "none", "end_training", "shutdown"))
    args = parser.parse_args()
    accelerator = Accelerator(cpu=True)
    hf_ring.setup_sequence_parallel(accelerator, sp_size=dist.get_world_size())
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="ring_dilated").train()
    ids = torch.randint(0, model.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(0))
    model(**hf_ring.shard_batch({"input_ids": ids, "labels": ids})).loss.backward()
    hf_ring.sync_gradients(model)
    if args.ending == "destroy":
        dist.destroy_process_group()
    elif args.ending == "end_training":
        accelerator.end_training()
    elif args.ending == "shutdown":
        hf_ring.shutdown()


if __name__ == "__main__":
    main()
