#!/usr/bin/env python3
"""Writes the weights of a PyTorch nn.MultiheadAttention as .npy files that
`mha-run module --weights DIR` reads: one file per state_dict entry, named as
its key (in_proj_weight.npy, in_proj_bias.npy, out_proj.weight.npy,
out_proj.bias.npy, or q_proj_weight.npy, k_proj_weight.npy, v_proj_weight.npy
when kdim or vdim differ from embed_dim), float32, plus config.json with the
number of heads (which the weights do not record).

From the command line, with a state_dict saved by torch.save:

    torch.save(mha.state_dict(), "mha.pt")          # in your program
    python3 export_torch_weights.py mha.pt weights/ --num-heads 8
    # a bigger model's state_dict: select the module's entries by their prefix
    python3 export_torch_weights.py model.pt weights/ --num-heads 8 \
        --prefix encoder.layers.0.self_attn.

From Python, with the module itself (num_heads and batch_first come from it):

    from export_torch_weights import export
    export(mha, "weights/")

Then:  mha-run module --weights weights/ --query q.npy --out out.npy
(add --sequence-first when the module has batch_first=False, PyTorch's default,
and the inputs are [L, B, E]).  Needs PyTorch and NumPy.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch

# The entries of nn.MultiheadAttention's state_dict that mha understands.
SUPPORTED = {
    "in_proj_weight",
    "q_proj_weight",
    "k_proj_weight",
    "v_proj_weight",
    "in_proj_bias",
    "out_proj.weight",
    "out_proj.bias",
}


def export(source, out_dir, num_heads=None, prefix=""):
    """Writes the .npy files and config.json; source is an
    nn.MultiheadAttention or a state_dict (then num_heads is required)."""
    config = {}
    if isinstance(source, torch.nn.MultiheadAttention):
        state = source.state_dict()
        num_heads = source.num_heads
        config.update(
            embed_dim=source.embed_dim,
            kdim=source.kdim,
            vdim=source.vdim,
            batch_first=source.batch_first,
            dropout=source.dropout,
        )
    else:
        state = source
    if num_heads is None:
        raise ValueError("the number of heads is not in a state_dict: pass num_heads")

    entries = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not entries:
        raise ValueError(f"no state_dict entry starts with the prefix {prefix!r}")
    if "bias_k" in entries or "bias_v" in entries:
        raise ValueError("add_bias_kv=True is not supported by mha")
    unknown = sorted(set(entries) - SUPPORTED)
    if unknown:
        raise ValueError(f"not entries of nn.MultiheadAttention: {unknown} (wrong --prefix?)")

    os.makedirs(out_dir, exist_ok=True)
    for key, tensor in sorted(entries.items()):
        array = tensor.detach().to("cpu", torch.float32).contiguous().numpy()
        np.save(os.path.join(out_dir, key + ".npy"), array)
        print(f"{key}.npy {tuple(array.shape)}")
    config["num_heads"] = int(num_heads)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    print(f"config.json: {config}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("state_dict", help="a file written by torch.save(module.state_dict(), ...)")
    parser.add_argument("out_dir", help="directory for the .npy files (created if missing)")
    parser.add_argument("--num-heads", type=int, required=True, help="the module's num_heads")
    parser.add_argument("--prefix", default="", help="key prefix of the module in a bigger model")
    args = parser.parse_args()
    state = torch.load(args.state_dict, map_location="cpu")
    if isinstance(state, torch.nn.MultiheadAttention):
        state = state.state_dict()
    try:
        export(state, args.out_dir, num_heads=args.num_heads, prefix=args.prefix)
    except ValueError as e:
        sys.exit(f"export_torch_weights: {e}")


if __name__ == "__main__":
    main()
