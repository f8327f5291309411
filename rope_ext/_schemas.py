"""The op schemas, read from schemas.def beside this file: the one list, from which
csrc/ops/rope.cpp defines the ops too.

Used to define the ops from Python when no native library is loaded, so that `torch.ops.rope.*`
exists either way. Keys are "name" or "name.overload", as the dispatcher spells them after
"rope::"; values are the full schema.
"""

import os
import re

_OP = re.compile(r'^ROPE_OP\(\s*"([^"]+)",\s*\w+,\s*((?:"(?:[^"\\]|\\.)*"\s*)+)\)', re.M)
_LITERAL = re.compile(r'"((?:[^"\\]|\\.)*)"')


def _read():
    with open(os.path.join(os.path.dirname(__file__), "schemas.def")) as f:
        text = f.read()
    schemas = {}
    for name, literals in _OP.findall(text):
        # adjacent C++ string literals, concatenated; \" is the only escape they use
        signature = "".join(s.replace('\\"', '"') for s in _LITERAL.findall(literals))
        schemas[name] = name + signature
    return schemas


SCHEMAS = _read()
