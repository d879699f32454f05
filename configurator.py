"""
configurator.py: the config of a script (train.py, sample.py) from its defaults block, config
files and --key=value arguments, applied in that order.

A script's defaults are the plain module-level assignments between its two `# ---` lines; the
comment on each line is that key's meaning in --help. A config file is plain Python that assigns
some of those names. --key=value is parsed as a Python literal (True, 3, 1e-3, None...) or else
taken as a string, and checked against the default's type.
"""
import ast
import builtins
import difflib
import io
import math
import os
import sys
import tokenize
import types


class ConfigError(ValueError):
    pass


def _set(cfg, defaults, nullable, choices, key, value, source):
    if key not in defaults:
        close = difflib.get_close_matches(key, defaults, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else \
            "; the valid keys are listed by --help"
        raise ConfigError(f"unknown config key {key!r} (from {source}){hint}")
    default = defaults[key]
    want = nullable.get(key, type(default))
    if isinstance(default, float) and type(value) is int:
        try:
            value = float(value)
        except OverflowError:
            raise ConfigError(f"config key {key!r} (from {source}): {value} is too large for a "
                              f"float") from None
    if not ((value is None and key in nullable) or type(value) is want):
        raise ConfigError(f"config key {key!r} (from {source}) must be {want.__name__}"
                          f"{' or None' if key in nullable else ''}, got {type(value).__name__} "
                          f"{value!r}")
    if key in choices and value not in choices[key]:
        raise ConfigError(f"config key {key!r} (from {source}) must be one of {choices[key]}, "
                          f"got {value!r}")
    cfg[key] = value


def _parse_value(raw, want, can_be_none=False):
    """--key=value: a Python literal (True, 3, 1e-3, None...), else the raw string. A key that
    holds text takes the text as written (--out_dir=2024, --start=True), None only where the
    key may be None."""
    if want is not str and raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw
    if want is str and not isinstance(value, str):
        return None if value is None and can_be_none else raw
    return value


def _run_config_file(path):
    """The names a config file assigns (modules, functions and _private names left out)."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} not found")
    root = os.path.dirname(os.path.abspath(__file__))
    if root not in sys.path:   # lets config files `from configs._x import *`
        sys.path.insert(0, root)
    ns = {"__file__": path, "__name__": "__config__"}
    # its own folder too, as Python gives a script it runs (`from base import *` beside it); the
    # modules found there are forgotten after, so another folder's base.py is not taken for it
    here, before = os.path.dirname(os.path.abspath(path)), set(sys.modules)
    sys.path.insert(0, here)
    try:   # bytes, so Python reads a BOM and a coding line as it would running the file
        with open(path, "rb") as f:
            exec(builtins.compile(f.read(), path, "exec"), ns)  # `compile` is a config key
    except SyntaxError as e:
        raise ConfigError(f"config file {path}, line {e.lineno}: {e.msg}: fix the Python "
                          f"syntax there") from None
    except Exception as e:
        raise ConfigError(f"config file {path} fails when run: {type(e).__name__}: {e}") from None
    finally:
        sys.path.remove(here)
        for name in set(sys.modules) - before:   # (top-level modules: not configs._x)
            file = getattr(sys.modules[name], "__file__", None)
            if "." not in name and file and os.path.dirname(os.path.abspath(file)) == here != root:
                del sys.modules[name]
    return {k: v for k, v in ns.items()
            if not (k.startswith("_") or isinstance(v, types.ModuleType) or callable(v))}


def parse(argv, defaults, nullable=None, choices=None):
    """(config dict, the keys that config files or --key=value set) from argv: config files
    (paths) and --key=value, applied in order over `defaults`. `nullable`: the type a key whose
    default is None must have otherwise; `choices`: the values a key may take."""
    nullable, choices = nullable or {}, choices or {}
    cfg, given = dict(defaults), set()
    for arg in argv:
        if arg.startswith("--"):
            key, eq, raw = arg[2:].partition("=")
            want = nullable.get(key, type(defaults.get(key)))
            if not eq and key in defaults and want is bool:
                raw = "True"   # bare --flag
            elif not eq and key in defaults:
                raise ConfigError(f"expected --key=value, got {arg!r} (--help lists the keys)")
            _set(cfg, defaults, nullable, choices, key, _parse_value(raw, want, key in nullable), arg)
            given.add(key)
        else:
            for key, value in _run_config_file(arg).items():
                _set(cfg, defaults, nullable, choices, key, value, arg)
                given.add(key)
    return cfg, given


def _defaults_block(script):
    """[(line number, line)] between the first two `# ---` lines of a script."""
    with open(script) as f:
        lines = f.read().splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith("# ---")][:2]
    if len(marks) < 2:
        raise ValueError(f"{script} has no defaults block between two '# ---' lines")
    return [(i + 1, lines[i]) for i in range(marks[0] + 1, marks[1])]


def defaults_of(namespace):
    """{key: value} of the names a script's defaults block assigns (`namespace`: its globals())."""
    keys = [line.split("=", 1)[0].strip() for _, line in _defaults_block(namespace["__file__"])
            if "=" in line and not line.startswith("#")]
    return {k: namespace[k] for k in keys}


def check_ranges(cfg, rules):
    """rules: {key: (test, what the value must be)}; the first key whose value fails is a
    ConfigError. Every float must also be finite."""
    for key, value in cfg.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} must be a finite number")
    for key, (test, want) in rules.items():
        if cfg.get(key) is not None and not test(cfg[key]):
            raise ConfigError(f"{key}={cfg[key]!r} is out of range: it must be {want}")


def check_device(device):
    """'auto', 'cpu', 'cuda' or 'cuda:N' that this machine has; else a one-line ConfigError."""
    import torch
    if device in ("auto", "cpu"):
        return
    try:
        d = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device={device!r} is not a device: use 'auto', 'cpu', 'cuda' or "
                          f"'cuda:N'") from None
    if d.type != "cuda":
        raise ConfigError(f"device={device!r}: nanoFP4 runs on 'cpu' or 'cuda'")
    if not torch.cuda.is_available():
        raise ConfigError(f"device={device!r}, but this machine has no CUDA GPU (torch "
                          f"{torch.__version__}): use --device=cpu or --device=auto")
    if d.index is not None and d.index >= torch.cuda.device_count():
        raise ConfigError(f"device={device!r}, but this machine has {torch.cuda.device_count()} "
                          f"GPU(s): use cuda:0 to cuda:{torch.cuda.device_count() - 1}")


def check_backend(backend, device):
    """backend='triton' needs a CUDA device (after check_device: 'auto' means cuda if present)."""
    import torch
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if backend == "triton" and not cuda:
        raise ConfigError("backend='triton' runs the Triton kernels on a CUDA GPU, and this run "
                          "is on the CPU: use backend='auto' or 'torch'")


def resolve_device(device, dtype):
    """'auto' made concrete: (cuda when present else cpu, bf16 on a GPU else fp32)."""
    import torch
    dev = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    return dev, dtype if dtype != "auto" else ("bfloat16" if dev.startswith("cuda") else "float32")


def wants_help(argv):
    return any(a in ("-h", "--help") for a in argv)


def help_text(script, defaults, nullable=None, usage=""):
    """Every key of a script's defaults block: its default, type and the line's comment."""
    nullable = nullable or {}
    with open(script) as f:
        source = f.read()
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    out = [usage.strip(), "", "config keys:"]
    block = _defaults_block(script)
    for index, (number, line) in enumerate(block):
        name = line.split("=", 1)[0].strip()
        if name in defaults:
            kind = nullable.get(name, type(defaults[name])).__name__
            kind += " or None" if name in nullable else ""
            out.append(f"  --{name}={defaults[name]!r}  ({kind}) {comments.get(number, '')}")
        elif line.startswith("#") and _keys_follow(block, index):   # a section's title
            out += ["", comments[number]]
    return "\n".join(out).strip()


def _keys_follow(block, index):
    """Whether a key comes after block[index] before the next comment line (a comment with no
    key of its own, e.g. the block's own heading, is no section)."""
    for _, line in block[index + 1:]:
        if line.startswith("#"):
            return False
        if "=" in line:
            return True
    return False
