#!/usr/bin/env python3
"""Writes the weights of a PyTorch nn.MultiheadAttention as .npy files that
`mha-run module --weights DIR` reads: one file per state_dict entry, named as
its key (in_proj_weight.npy, in_proj_bias.npy, out_proj.weight.npy,
out_proj.bias.npy, or q_proj_weight.npy, k_proj_weight.npy, v_proj_weight.npy
when kdim or vdim differ from embed_dim), float32, plus config.json with every
argument of the module's constructor: embed_dim, num_heads, dropout, bias,
add_bias_kv, add_zero_attn, kdim, vdim, batch_first.

Installed as `mha-export-torch-weights`; from the command line, with a
state_dict saved by torch.save:

    torch.save(mha.state_dict(), "mha.pt")          # in your program
    mha-export-torch-weights mha.pt weights/ --num-heads 8
    # a module made with batch_first=True (the state_dict does not record it;
    # the default is PyTorch's, batch_first=False: inputs [L, B, E])
    mha-export-torch-weights mha.pt weights/ --num-heads 8 --batch-first
    # a bigger model's state_dict: select the module's entries by their prefix
    mha-export-torch-weights model.pt weights/ --num-heads 8 \\
        --prefix encoder.layers.0.self_attn.

A state_dict records the weights, not the constructor's arguments: embed_dim,
kdim, vdim and bias are inferred from the entries (their shapes, the presence
of in_proj_bias); --embed-dim, --kdim, --vdim and --bias/--no-bias, when
given, must agree with them.  num_heads (--num-heads) is required; dropout
(--dropout) and batch_first (--batch-first/--no-batch-first) take PyTorch's
defaults, 0.0 and False, unless given.  add_bias_kv=True (bias_k and bias_v
entries, or --add-bias-kv) and add_zero_attn=True (--add-zero-attn) are
refused: the mha module does not support them.

From Python, with the module itself (every argument comes from it):

    from export_torch_weights import export
    export(mha, "weights/")

Then:  mha-run module --weights weights/ --query q.npy --out out.npy
(mha-run reads batch_first from config.json: [L, B, E] inputs when it is
false).  Writing the .npy files needs PyTorch and NumPy.
"""
import argparse
import json
import os
import sys

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

# config.json's keys, in the order of nn.MultiheadAttention's constructor.
CONFIG_KEYS = (
    "embed_dim",
    "num_heads",
    "dropout",
    "bias",
    "add_bias_kv",
    "add_zero_attn",
    "kdim",
    "vdim",
    "batch_first",
)


def _is_module(source):
    """An nn.MultiheadAttention, or anything that looks like one."""
    return hasattr(source, "state_dict") and hasattr(source, "num_heads")


def module_arguments(module):
    """The constructor's arguments of an nn.MultiheadAttention, read back."""
    return {
        "embed_dim": int(module.embed_dim),
        "num_heads": int(module.num_heads),
        "dropout": float(module.dropout),
        "bias": getattr(module, "in_proj_bias", None) is not None,
        "add_bias_kv": getattr(module, "bias_k", None) is not None,
        "add_zero_attn": bool(getattr(module, "add_zero_attn", False)),
        "kdim": int(module.kdim),
        "vdim": int(module.vdim),
        "batch_first": bool(getattr(module, "batch_first", False)),
    }


def _shape(value):
    return tuple(int(n) for n in value.shape)


def build_config(entries, num_heads, embed_dim=None, kdim=None, vdim=None, bias=None,
                 dropout=None, batch_first=None, add_bias_kv=None, add_zero_attn=None):
    """config.json for the entries of a state_dict (key -> anything with a
    .shape): what the entries tell (embed_dim, kdim, vdim, bias, add_bias_kv)
    is inferred and must agree with what is given; the rest takes PyTorch's
    defaults.  Raises ValueError."""
    if num_heads is None:
        raise ValueError("the number of heads is not in a state_dict: pass num_heads (--num-heads)")
    if "bias_k" in entries or "bias_v" in entries or add_bias_kv:
        raise ValueError("add_bias_kv=True is not supported by mha")
    if add_zero_attn:
        raise ValueError("add_zero_attn=True is not supported by mha")
    unknown = sorted(set(entries) - SUPPORTED)
    if unknown:
        raise ValueError(f"not entries of nn.MultiheadAttention: {unknown} (wrong --prefix?)")

    shapes = {key: _shape(value) for key, value in entries.items()}
    if "out_proj.weight" in shapes:
        e = shapes["out_proj.weight"][0]
    elif "in_proj_weight" in shapes:
        e = shapes["in_proj_weight"][1]
    elif "q_proj_weight" in shapes:
        e = shapes["q_proj_weight"][0]
    else:
        raise ValueError("no out_proj.weight, in_proj_weight or q_proj_weight: "
                         "cannot tell embed_dim")
    found = {
        "embed_dim": e,
        "kdim": shapes["k_proj_weight"][1] if "k_proj_weight" in shapes else e,
        "vdim": shapes["v_proj_weight"][1] if "v_proj_weight" in shapes else e,
        "bias": "in_proj_bias" in shapes or "out_proj.bias" in shapes,
    }
    given = {"embed_dim": embed_dim, "kdim": kdim, "vdim": vdim, "bias": bias}
    for key, value in given.items():
        if value is not None and value != found[key]:
            raise ValueError(f"{key}={value!r} was given, but the state_dict says "
                             f"{key}={found[key]!r}")
    if int(num_heads) <= 0 or e % int(num_heads) != 0:
        raise ValueError(f"num_heads={num_heads} does not divide embed_dim={e}")
    if dropout is not None and not 0.0 <= float(dropout) <= 1.0:
        raise ValueError(f"dropout={dropout} is not in [0, 1]")
    config = {
        "embed_dim": int(e),
        "num_heads": int(num_heads),
        "dropout": float(dropout) if dropout is not None else 0.0,
        "bias": bool(found["bias"]),
        "add_bias_kv": False,
        "add_zero_attn": False,
        "kdim": int(found["kdim"]),
        "vdim": int(found["vdim"]),
        "batch_first": bool(batch_first) if batch_first is not None else False,
    }
    assert tuple(config) == CONFIG_KEYS
    return config


def prepare(source, num_heads=None, prefix="", **arguments):
    """The state_dict entries to write (prefix removed) and config.json.
    source is an nn.MultiheadAttention (its own arguments are used; those
    given must agree) or a state_dict."""
    if _is_module(source):
        own = module_arguments(source)
        if own["add_bias_kv"]:
            raise ValueError("add_bias_kv=True is not supported by mha")
        if own["add_zero_attn"]:
            raise ValueError("add_zero_attn=True is not supported by mha")
        for key, value in list(arguments.items()) + [("num_heads", num_heads)]:
            if value is not None and value != own[key]:
                raise ValueError(f"{key}={value!r} was given, but the module has "
                                 f"{key}={own[key]!r}")
        state = source.state_dict()
        num_heads = own["num_heads"]
        arguments = {k: own[k] for k in ("dropout", "batch_first", "embed_dim", "kdim", "vdim",
                                         "bias")}
    else:
        state = source
    entries = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not entries:
        raise ValueError(f"no state_dict entry starts with the prefix {prefix!r}")
    return entries, build_config(entries, num_heads, **arguments)


def write_config(out_dir, config):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def _to_numpy(value):
    import numpy as np

    if hasattr(value, "detach"):  # a torch.Tensor
        import torch

        value = value.detach().to("cpu", torch.float32).contiguous().numpy()
    return np.ascontiguousarray(value, dtype=np.float32)


def export(source, out_dir, num_heads=None, prefix="", **arguments):
    """Writes the .npy files and config.json; source is an
    nn.MultiheadAttention or a state_dict (then num_heads is required).
    Keyword arguments: embed_dim, kdim, vdim, bias, dropout, batch_first,
    add_bias_kv, add_zero_attn (see build_config)."""
    import numpy as np

    entries, config = prepare(source, num_heads=num_heads, prefix=prefix, **arguments)
    os.makedirs(out_dir, exist_ok=True)
    for key, tensor in sorted(entries.items()):
        array = _to_numpy(tensor)
        np.save(os.path.join(out_dir, key + ".npy"), array)
        print(f"{key}.npy {tuple(array.shape)}")
    write_config(out_dir, config)
    print(f"config.json: {config}")
    return config


def parser():
    p = argparse.ArgumentParser(
        prog="mha-export-torch-weights",
        description="Writes an nn.MultiheadAttention's state_dict as .npy files and config.json "
        "for `mha-run module --weights DIR`.")
    p.add_argument("state_dict", help="a file written by torch.save(module.state_dict(), ...)")
    p.add_argument("out_dir", help="directory for the .npy files (created if missing)")
    p.add_argument("--num-heads", type=int, required=True, help="the module's num_heads")
    p.add_argument("--prefix", default="", help="key prefix of the module in a bigger model")
    p.add_argument("--embed-dim", type=int, help="embed_dim (default: from the weights)")
    p.add_argument("--kdim", type=int, help="kdim (default: from the weights)")
    p.add_argument("--vdim", type=int, help="vdim (default: from the weights)")
    p.add_argument("--bias", action=argparse.BooleanOptionalAction, default=None,
                   help="bias (default: whether the state_dict has in_proj_bias)")
    p.add_argument("--dropout", type=float, help="dropout (default 0.0)")
    p.add_argument("--batch-first", action=argparse.BooleanOptionalAction, default=None,
                   help="batch_first (default: False, PyTorch's default)")
    p.add_argument("--add-bias-kv", action="store_true",
                   help="add_bias_kv=True (refused: mha does not support it)")
    p.add_argument("--add-zero-attn", action="store_true",
                   help="add_zero_attn=True (refused: mha does not support it)")
    return p


def arguments_of(args):
    """The constructor arguments given on the command line."""
    return {
        "embed_dim": args.embed_dim,
        "kdim": args.kdim,
        "vdim": args.vdim,
        "bias": args.bias,
        "dropout": args.dropout,
        "batch_first": args.batch_first,
        "add_bias_kv": args.add_bias_kv or None,
        "add_zero_attn": args.add_zero_attn or None,
    }


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        import torch

        state = torch.load(args.state_dict, map_location="cpu")
        if isinstance(state, torch.nn.MultiheadAttention):
            state = state.state_dict()
        export(state, args.out_dir, num_heads=args.num_heads, prefix=args.prefix,
               **arguments_of(args))
    except ImportError as e:
        sys.exit(f"mha-export-torch-weights: needs PyTorch and NumPy ({e})")
    except ValueError as e:
        sys.exit(f"mha-export-torch-weights: {e}")


if __name__ == "__main__":
    main()
