"""The code reward's child: runs inside the sandbox, loads the solution and answers calls into it.

Stdlib only; the parent passes this file's text as the sandboxed program, the solution as `solution.py`.
It holds no secret: no expected value, no test source, no verdict. It only reports what the solution did,
as plain JSON, and the parent (code_judge.py) compares. Whatever the solution does to this process
(patching json or builtins, walking frames, writing to fd 4 itself) can only change the values reported
as its own results, which is what any solution controls anyway.

Protocol: JSON lines, requests on fd 3, replies on fd 4 (stdin/stdout/stderr go to /dev/null, so the
solution's prints reach nobody). First reply {"id": 0, "ready": true}; then per request
{"id", "op", "target", "args", "kwargs"} with op load | call | iter | len | bool | exit, the reply
{"id", "ok": true, "value": V} or {"id", "ok": false, "error": exception type name, "message"}; a call
that got lists, dicts or sets also returns their state afterwards ("args_after", "kwargs_after"), so that
the parent can apply in-place changes to its own copies.

Values V (both directions): null, booleans, ints, strings, finite floats and lists as JSON; tagged
objects {"$tuple"|"$set"|"$frozenset": [V...]}, {"$dict": [[K, V]...]}, {"$bytes": latin-1 text},
{"$float": "nan"|"inf"|"-inf"}, {"$complex": [re, im]}; any other object (a subclass of a built-in type
too: it could override __eq__) stays here and is sent as {"$ref": n, "type": name}. numpy scalars are
sent as their .item().
"""

import builtins
import json
import math
import os
import sys

_MAX_DEPTH = 200
_MAX_ITEMS = 1_000_000
_NONE = type(None)


class _Unsendable(Exception):
    pass


class Codec:
    """Plain values <-> JSON-ready data; objects that are not plain live in `refs`."""

    def __init__(self, ns):
        self.ns = ns
        self.refs = {}
        self.items = 0

    def encode(self, x, depth=0):
        self.items += 1
        if depth > _MAX_DEPTH or self.items > _MAX_ITEMS:
            raise _Unsendable("value too deep or too large to send")
        t = type(x)
        if t is _NONE or t is bool or t is int or t is str:  # identity: a metaclass may fake __eq__
            return x
        if t is float:
            return x if math.isfinite(x) else {"$float": repr(x)}
        if t is list:
            return [self.encode(v, depth + 1) for v in x]
        if t is tuple or t is set or t is frozenset:
            tag = "$" + t.__name__
            items = [self.encode(v, depth + 1) for v in x]
            return {tag: items}
        if t is dict:
            return {"$dict": [[self.encode(k, depth + 1), self.encode(v, depth + 1)] for k, v in x.items()]}
        if t is bytes:
            return {"$bytes": x.decode("latin-1")}
        if t is complex:
            return {"$complex": [self.encode(x.real, depth + 1), self.encode(x.imag, depth + 1)]}
        if getattr(t, "__module__", "") == "numpy" and hasattr(x, "item") and hasattr(x, "dtype") \
                and getattr(x, "ndim", None) == 0:
            return self.encode(x.item(), depth + 1)
        n = len(self.refs) + 1
        self.refs[n] = x
        return {"$ref": n, "type": str(getattr(t, "__name__", "?"))[:100]}

    def decode(self, v):
        if isinstance(v, list):
            return [self.decode(x) for x in v]
        if not isinstance(v, dict):
            return v
        (tag, body), = v.items() if len(v) == 1 else (("$ref", v.get("$ref")),)
        if tag == "$tuple":
            return tuple(self.decode(x) for x in body)
        if tag == "$set":
            return {self.decode(x) for x in body}
        if tag == "$frozenset":
            return frozenset(self.decode(x) for x in body)
        if tag == "$dict":
            return {self.decode(k): self.decode(x) for k, x in body}
        if tag == "$bytes":
            return body.encode("latin-1")
        if tag == "$float":
            return float(body)
        if tag == "$complex":
            return complex(body[0], body[1])
        if tag == "$ref":
            return self.refs[body]
        if tag == "$name":
            return self.resolve({"name": body, "attrs": []})
        raise ValueError("unknown value tag %r" % tag)

    def resolve(self, target):
        if "ref" in target:
            obj = self.refs[target["ref"]]
        else:
            name = target["name"]
            if name not in self.ns:
                raise NameError("name %r is not defined" % name)
            obj = self.ns[name]
        for attr in target.get("attrs", []):
            obj = getattr(obj, attr)
        return obj


def _describe(e):
    try:
        name = type(e).__name__
        msg = str(e)
    except BaseException:  # noqa: BLE001 - the solution's exception may not even print
        return "Exception", "<unprintable>"
    return str(name)[:100], msg[:500]


def main():
    send_fd, recv_fd = 4, 3
    dumps, loads, write, read = json.dumps, json.loads, os.write, os.read  # before the solution can patch them
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)

    def send(obj):
        data = (dumps(obj) + "\n").encode("utf-8", "surrogatepass")
        while data:
            data = data[write(send_fd, data):]

    buf = bytearray()

    def recv():
        while b"\n" not in buf:
            chunk = read(recv_fd, 1 << 16)
            if not chunk:
                return None
            buf.extend(chunk)
        i = buf.index(b"\n")
        line = bytes(buf[:i])
        del buf[:i + 1]
        return loads(line)

    ns = {"__name__": "solution", "__builtins__": builtins}
    codec = Codec(ns)
    send({"id": 0, "ready": True})
    while True:
        req = recv()
        if req is None or req.get("op") == "exit":
            break
        rid, op = req.get("id"), req.get("op")
        try:
            codec.items = 0
            if op == "load":
                with open("solution.py", encoding="utf-8") as fh:
                    src = fh.read()
                exec(compile(src, "solution.py", "exec"), ns)
                value = None
            else:
                obj = codec.resolve(req["target"])
                if op == "call":
                    args = [codec.decode(a) for a in req.get("args", [])]
                    kwargs = {k: codec.decode(a) for k, a in req.get("kwargs", {}).items()}
                    value = obj(*args, **kwargs)
                    mutable = (list, dict, set)
                    after = [a if type(a) in mutable else None for a in args]
                    kw_after = {k: a for k, a in kwargs.items() if type(a) in mutable}
                elif op == "iter":
                    value = list(obj)
                elif op == "len":
                    value = len(obj)
                elif op == "bool":
                    value = bool(obj)
                else:
                    raise ValueError("unknown op %r" % op)
            codec.items = 0
            reply = {"id": rid, "ok": True, "value": codec.encode(value)}
            if op == "call" and (any(a is not None for a in after) or kw_after):
                # the state of mutable arguments after the call: tests of in-place functions see it
                reply["args_after"] = [None if a is None else codec.encode(a) for a in after]
                reply["kwargs_after"] = {k: codec.encode(a) for k, a in kw_after.items()}
        except BaseException as e:  # noqa: BLE001 - SystemExit and friends from the solution are results too
            name, msg = _describe(e)
            reply = {"id": rid, "ok": False, "error": name, "message": msg}
        try:
            send(reply)
        except (TypeError, ValueError) as e:  # e.g. a string with lone surrogates
            send({"id": rid, "ok": False, "error": "TypeError", "message": "cannot send the result: %s" % e})


if __name__ == "__main__":
    main()
