#!/usr/bin/env python3
"""The export script's config.json, without PyTorch or NumPy: the arguments
inferred from a state_dict's shapes, the ones given on the command line, the
refusals, and the arguments read back from a module.

    export_config_test.py TOOLS_DIR OUT_DIR
"""
import json
import os
import sys
import unittest

sys.path.insert(0, sys.argv[1])
OUT_DIR = sys.argv[2]
del sys.argv[1:]
import export_torch_weights as ex  # noqa: E402


class Fake:
    """Anything with a shape, as a tensor of the state_dict."""

    def __init__(self, *shape):
        self.shape = shape


def packed(e=8, bias=True):
    d = {"in_proj_weight": Fake(3 * e, e), "out_proj.weight": Fake(e, e)}
    if bias:
        d.update({"in_proj_bias": Fake(3 * e), "out_proj.bias": Fake(e)})
    return d


class FakeModule:
    """The attributes nn.MultiheadAttention keeps of its arguments."""

    def __init__(self, **kw):
        self.embed_dim = kw.get("embed_dim", 8)
        self.num_heads = kw.get("num_heads", 2)
        self.dropout = kw.get("dropout", 0.1)
        self.kdim = kw.get("kdim", self.embed_dim)
        self.vdim = kw.get("vdim", self.embed_dim)
        self.batch_first = kw.get("batch_first", True)
        self.add_zero_attn = kw.get("add_zero_attn", False)
        self.bias_k = Fake(1, 1, self.embed_dim) if kw.get("add_bias_kv") else None
        self.in_proj_bias = Fake(3 * self.embed_dim) if kw.get("bias", True) else None

    def state_dict(self):
        return packed(self.embed_dim, self.in_proj_bias is not None)


class Config(unittest.TestCase):
    def test_every_argument_with_pytorch_defaults(self):
        c = ex.build_config(packed(), 2)
        self.assertEqual(tuple(c), ex.CONFIG_KEYS)
        self.assertEqual(c, {"embed_dim": 8, "num_heads": 2, "dropout": 0.0, "bias": True,
                             "add_bias_kv": False, "add_zero_attn": False, "kdim": 8, "vdim": 8,
                             "batch_first": False})

    def test_inferred_from_the_state_dict(self):
        c = ex.build_config(packed(bias=False), 4)
        self.assertFalse(c["bias"])
        sep = {"q_proj_weight": Fake(8, 8), "k_proj_weight": Fake(8, 5),
               "v_proj_weight": Fake(8, 6), "out_proj.weight": Fake(8, 8),
               "in_proj_bias": Fake(24), "out_proj.bias": Fake(8)}
        c = ex.build_config(sep, 2)
        self.assertEqual((c["embed_dim"], c["kdim"], c["vdim"], c["bias"]), (8, 5, 6, True))

    def test_given_arguments(self):
        c = ex.build_config(packed(), 2, batch_first=True, dropout=0.25, embed_dim=8, bias=True)
        self.assertTrue(c["batch_first"])
        self.assertEqual(c["dropout"], 0.25)

    def test_refusals(self):
        for kwargs, message in [
            ({"add_zero_attn": True}, "add_zero_attn=True is not supported"),
            ({"add_bias_kv": True}, "add_bias_kv=True is not supported"),
            ({"bias": False}, "bias=False was given, but the state_dict says bias=True"),
            ({"embed_dim": 16}, "embed_dim=16 was given"),
            ({"kdim": 4}, "kdim=4 was given"),
            ({"num_heads": 3}, "num_heads=3 does not divide embed_dim=8"),
            ({"num_heads": None}, "pass num_heads"),
        ]:
            kwargs = dict({"num_heads": 2}, **kwargs)
            num_heads = kwargs.pop("num_heads")
            with self.assertRaisesRegex(ValueError, message):
                ex.build_config(packed(), num_heads, **kwargs)
        with self.assertRaisesRegex(ValueError, "add_bias_kv=True is not supported"):
            ex.build_config(dict(packed(), bias_k=Fake(1, 1, 8)), 2)
        with self.assertRaisesRegex(ValueError, "not entries of nn.MultiheadAttention"):
            ex.build_config(dict(packed(), other=Fake(1)), 2)

    def test_command_line(self):
        args = ex.parser().parse_args(["m.pt", "out", "--num-heads", "2", "--batch-first",
                                       "--no-bias", "--dropout", "0.5"])
        c = ex.build_config(packed(bias=False), args.num_heads, **ex.arguments_of(args))
        self.assertEqual((c["batch_first"], c["bias"], c["dropout"]), (True, False, 0.5))
        args = ex.parser().parse_args(["m.pt", "out", "--num-heads", "2", "--no-batch-first"])
        self.assertFalse(ex.build_config(packed(), 2, **ex.arguments_of(args))["batch_first"])
        args = ex.parser().parse_args(["m.pt", "out", "--num-heads", "2", "--add-zero-attn"])
        with self.assertRaisesRegex(ValueError, "add_zero_attn=True is not supported"):
            ex.build_config(packed(), 2, **ex.arguments_of(args))

    def test_module(self):
        entries, c = ex.prepare(FakeModule(batch_first=True, dropout=0.1))
        self.assertEqual(set(entries), set(packed()))
        self.assertEqual(c, {"embed_dim": 8, "num_heads": 2, "dropout": 0.1, "bias": True,
                             "add_bias_kv": False, "add_zero_attn": False, "kdim": 8, "vdim": 8,
                             "batch_first": True})
        _, c = ex.prepare(FakeModule(bias=False, batch_first=False))
        self.assertEqual((c["bias"], c["batch_first"]), (False, False))
        with self.assertRaisesRegex(ValueError, "add_zero_attn=True is not supported"):
            ex.prepare(FakeModule(add_zero_attn=True))
        with self.assertRaisesRegex(ValueError, "add_bias_kv=True is not supported"):
            ex.prepare(FakeModule(add_bias_kv=True))
        with self.assertRaisesRegex(ValueError, "batch_first=False was given"):
            ex.prepare(FakeModule(batch_first=True), batch_first=False)

    def test_prefix(self):
        state = {"enc.attn." + k: v for k, v in packed().items()}
        entries, _ = ex.prepare(state, num_heads=2, prefix="enc.attn.")
        self.assertEqual(set(entries), set(packed()))
        with self.assertRaisesRegex(ValueError, "no state_dict entry starts with"):
            ex.prepare(state, num_heads=2, prefix="dec.")

    def test_written_file(self):
        c = ex.build_config(packed(), 2, batch_first=True)
        ex.write_config(OUT_DIR, c)
        with open(os.path.join(OUT_DIR, "config.json")) as f:
            self.assertEqual(json.load(f), c)


if __name__ == "__main__":
    unittest.main(verbosity=2)
