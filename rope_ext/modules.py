"""nn.Module wrapper: holds the cos/sin table and rotates query/key by positions."""

import copy
import sys
from collections.abc import Mapping

import torch

from ._args import check_flag, check_int, mrope_section_arg
from ._checks import _check_positions_dtype, check_positions_in_range
from ._compiling import compiling
from .config import rope_kwargs_from_config
from .ops import apply_mrope_, apply_rope_, apply_rope_at
from .scaling import (default_inv_freq, dynamic_base, dynamic_parameters, original_length, rotated_dims,
                      rope_parameters, scaling_type)
from .tables import check_base, cos_sin_rows, table_rows


def _dtensor_module(t):
    """torch.distributed.tensor if t is a DTensor (the module only where already imported)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor if dtensor is not None and isinstance(t, dtensor.DTensor) else None


def _global_extremes(dtensor, positions):
    """(smallest, largest) of DTensor positions over every rank, plain 0-d int64 tensors: one
    all-reduce (max) where positions are sharded, of the largest and of the largest bitwise
    complement (~x = -x - 1, which maps int64 onto itself, where -x would overflow). A rank whose
    shard is empty (uneven shards) contributes int64's least; reducing there would fail on it
    alone."""
    local = positions.to_local().reshape(-1).long()
    if local.numel():
        ext = torch.stack((~local.amin(), local.amax()))
    else:  # below anything a shard gives
        ext = torch.full((2,), -(1 << 63), dtype=torch.int64, device=local.device)
    placements = [dtensor.Partial("max") if p.is_shard() else dtensor.Replicate()
                  for p in positions.placements]
    ext = dtensor.DTensor.from_local(ext, positions.device_mesh, placements, run_check=False)
    ext = ext.full_tensor()
    return ~ext[0], ext[1]


def _largest(positions):
    """positions' largest value, or -1 where there are none: a traced call (torch.compile,
    export) takes this path for every token count, 0 included, and amax of nothing is an
    error. (Eager calls with no positions return before it.)"""
    if not compiling():
        return positions.amax()
    flat = positions.reshape(-1)
    return torch.cat((flat, flat.new_full((1,), -1))).amax()


def _local(t):
    return t.to_local() if _dtensor_module(t) is not None else t


def _restored(new, old, dtype, build):
    """What Module._apply made of a state tensor (`new`, from `old`), holding old's values: copied
    into new's memory (which keeps what fn chose: its device, pinned or shared memory, a DTensor),
    or built again (`build(device)`) where new has another dtype, old has no values (meta), new
    cannot hold them (meta) or could not be updated outside inference mode."""
    with torch.inference_mode(False):
        if new.dtype == dtype and not (old.is_meta or new.is_meta or new.is_inference()):
            dst, src = _local(new), _local(old)
            if dst.shape == src.shape:
                dst.copy_(src)
                return new
        return build(new.device)


_STATE = ("_tables", "dynamic_len")  # RotaryEmbedding's buffers: built from its settings
# The settings the table is built from: fixed once it is (a cast or move builds it again, so an
# edit would take effect at some later cast: results depending on the module's history).
_BUILT_FROM = ("rotary_dim", "max_position", "base", "scaling", "seq_len")


class RotaryEmbedding(torch.nn.Module):
    """RoPE for attention: forward(query, key, positions) returns rotated copies of query
    (..., Hq, head_dim) and key (..., Hk, head_dim) (key may be None), differentiable.

    scaling: a `rope_scaling` dict (see rope_ext.cos_sin_cache). Two scalings depend on the
    length of the sequence, and the module follows it call by call as transformers does, with
    the length of a call being max(positions) + 1:
    - `longrope` (Phi-3): the short factors while the length is at most
      original_max_position_embeddings, the long ones past it. Both tables are built once and
      stacked (short rows first); a call picks its rows with a device-side offset.
    - `dynamic` (NTK): the base grows with the longest length seen so far, and returns to the
      original when a call is shorter than original_max_position_embeddings. That length is
      state (a buffer updated by tensor ops); the rows a call needs are computed on its device.
    seq_len: instead, one fixed table built for that length (no switching, no state).
    `mode` says which: "static" (one table), "longrope" or "dynamic"; `dynamic_len` is the
    dynamic-NTK length buffer.
    rope_dim_offset: the rotary dims are [rope_dim_offset, rope_dim_offset + rotary_dim) of each
    head (DeepSeek-V4 rotates the tail); the others pass through.
    mrope_section: 3 ints summing to rotary_dim/2 (Qwen2-VL); positions of shape
    (3,) + query.shape[:-2] then give each section its own position component, and positions of
    shape query.shape[:-2] (text only) stay plain RoPE. mrope_interleaved: the sections are laid
    out T,H,W,T,H,W,... across the pairs (Qwen3-VL) instead of one after another.

    The settings the table is built from (rotary_dim, max_position, base, scaling, seq_len) are
    fixed once it is: setting one is an error, and `scaling` reads as a copy.

    Positions outside [0, max_position) are an error on every device. forward does no
    host-device sync (no .item(), no Python branch on tensor values), so it runs under
    torch.compile and CUDA graph capture; on CUDA a bad position is a device-side assert.

    The table is a non-persistent float32 buffer; it follows the module across devices but keeps
    its float32 precision when the module is cast to a lower precision (RoPE tables in bf16/fp16
    cost model quality). A move or to_empty() keeps its values (copied into the new memory), as
    it keeps the dynamic-NTK length's; a cast builds the table again (the length is kept), and
    memory that had none ("meta"; also a loader's placeholder tensor set on a module built on
    meta, as transformers 5's from_pretrained sets) builds both (the length from the original).
    Under activation checkpointing, a dynamic-NTK module recomputes a layer with the length of
    the recomputation's time: call it outside the checkpointed layers (cos_sin, then the op), as
    transformers' models do. Under DistributedDataParallel, which
    broadcasts every buffer before each forward by default, see docs/distributed.md. A
    dynamic-NTK module's length is state: calls from several threads at once need a module
    each (as transformers' do).
    """

    def __init__(self, head_dim, *, rotary_dim=None, max_position=8192, base=10000.0,
                 interleaved=False, scaling=None, seq_len=None, mrope_section=None,
                 mrope_interleaved=False, rope_dim_offset=0):
        super().__init__()
        head_dim = check_int(head_dim, "RotaryEmbedding: head_dim", 1)
        max_position = check_int(max_position, "RotaryEmbedding: max_position", 1)
        freq_dim = head_dim if rotary_dim is None else check_int(rotary_dim, "RotaryEmbedding: rotary_dim")
        rotary_dim = rotated_dims(freq_dim)
        if not 0 < freq_dim <= head_dim or rotary_dim > head_dim:
            raise ValueError(f"RotaryEmbedding: rotary_dim must be in (0, head_dim={head_dim}], and an odd "
                             f"one rotates one dim more (rotary_dim + 1 <= head_dim), got {freq_dim}")
        if isinstance(rope_dim_offset, bool) or not isinstance(rope_dim_offset, int) or \
                not 0 <= rope_dim_offset <= head_dim - rotary_dim:
            raise ValueError(f"RotaryEmbedding: rope_dim_offset must be an int in [0, head_dim - "
                             f"rotary_dim] = [0, {head_dim - rotary_dim}], got {rope_dim_offset!r}")
        self.rope_dim_offset = rope_dim_offset
        # None: the default (a config's rope_scaling.get("mrope_interleaved"), a key Qwen2-VL lacks)
        interleaved = interleaved is not None and check_flag(interleaved, "RotaryEmbedding: interleaved")
        mrope_interleaved = mrope_interleaved is not None and \
            check_flag(mrope_interleaved, "RotaryEmbedding: mrope_interleaved")
        if mrope_section is not None:
            try:
                section = mrope_section_arg(mrope_section)
            except ValueError:
                section = None
            if section is None or len(section) != 3 or min(section) < 0 or sum(section) != rotary_dim // 2:
                raise ValueError(
                    f"RotaryEmbedding: mrope_section must be 3 ints >= 0 summing to rotary_dim/2 = "
                    f"{rotary_dim // 2}, got {mrope_section!r}")
            mrope_section = section
        elif mrope_interleaved:
            raise ValueError("RotaryEmbedding: mrope_interleaved=True needs mrope_section (the pairs "
                             "of each of the 3 position components)")
        if scaling is not None and not isinstance(scaling, Mapping):
            raise ValueError(f"RotaryEmbedding: scaling must be a dict (a config's rope_scaling) or "
                             f"None, got {scaling!r}")
        check_base(base, "RotaryEmbedding")
        if seq_len is not None:
            seq_len = check_int(seq_len, "RotaryEmbedding: seq_len", 1)
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim  # the dims rotated: the table's width
        self._freq_dim = freq_dim  # the d of the frequencies base^(-2i/d)
        self.max_position = max_position
        self.base = base
        self.interleaved = interleaved
        # a copy of its own: a config edited later must not change the tables it rebuilds
        self._scaling = None if scaling is None else copy.deepcopy(dict(scaling))
        self.seq_len = seq_len
        self.mrope_section = mrope_section
        self.mrope_interleaved = mrope_interleaved

        # "static": one table; "longrope": short rows then long rows; "dynamic": growing base.
        self.mode, self._original = "static", None
        kind = scaling_type(self._scaling)
        # The module's state is made outside inference mode even when built in it: an inference
        # tensor could not be updated (dynamic_len) or saved for backward (the table) outside.
        with torch.inference_mode(False):
            if seq_len is None and kind == "longrope":
                original = original_length(self._scaling)
                if max_position > original:  # otherwise every call reads the short rows
                    self.mode, self._original = "longrope", original
            elif seq_len is None and kind == "dynamic":
                self._factor, original = dynamic_parameters(self._scaling, freq_dim)
                if max_position > original:  # otherwise no call can grow it: the plain table is exact
                    self.mode, self._original = "dynamic", original
                    self.register_buffer("dynamic_len", torch.tensor(original, dtype=torch.int64),
                                         persistent=False)
            self.register_buffer("_tables", self._build(None), persistent=False)

    @classmethod
    def from_config(cls, config, *, layer_type=None, interleaved=None, max_position=None, seq_len=None):
        """Builds the module from a model config (a config.json as a dict, or a transformers-style
        config object; docs/models.md lists what is read). layer_type: which layers' RoPE, for
        configs that set it per layer type (Gemma 3: "full_attention" or "sliding_attention");
        required there, and checked against the config's layer_types where it lists them.
        `interleaved` overrides the layout the config implies (rope_ext.config.layout_from_config);
        `max_position` the table length (default: max_position_embeddings, and for dynamic and
        yarn scalings at least original * factor)."""
        kwargs = rope_kwargs_from_config(config, layer_type=layer_type, interleaved=interleaved,
                                         max_position=max_position)
        return cls(**kwargs, seq_len=seq_len)

    # ---- tables --------------------------------------------------------------------------

    def _rows_for(self, length, seq_len, device):
        inv_freq, attention = rope_parameters(self._scaling, self._freq_dim, self.base, self.max_position,
                                              seq_len, device)
        return table_rows(length, inv_freq, attention, torch.float32, device)

    def _build(self, device):
        if self.mode == "longrope":  # the original length reads the short set, one more the long
            short = self._rows_for(self._original, self._original, device)
            return torch.cat((short, self._rows_for(self.max_position, self._original + 1, device)))
        # For dynamic NTK: the table of a call covering every position (grown to max_position).
        return self._rows_for(self.max_position, self.seq_len, device)

    @property
    def scaling(self):
        """The `rope_scaling` dict the table was built from (a copy), or None."""
        return copy.deepcopy(self._scaling)

    @property
    def cos_sin_cache(self):
        """The (max_position, rotary_dim) float32 table a call covering positions
        0..max_position-1 reads (for longrope: the long rows; for dynamic NTK: the base grown to
        max_position). Calls with shorter lengths may read other rows (see the class doc)."""
        return self._tables if self.mode != "longrope" else self._tables[self._original:]

    def _restore(self, name, new, old):
        """The state tensor `name` once `new` has taken the place of `old`: holding old's values,
        in new's memory where it can (see _restored)."""
        if name == "_tables":
            return _restored(new, old, torch.float32, self._build)

        def build(device):  # the length kept, as an int64; from the original after meta
            if old.is_meta:
                return torch.tensor(self._original, dtype=torch.int64, device=device)
            return old.to(device, torch.int64, copy=True)

        return _restored(new, old, torch.int64, build)

    def _apply(self, fn, recurse=True):
        # fn may cast (.half(), .type()), move (.to(device), pin or share memory) or hand back
        # memory with no values in it (to_empty(), also of a module whose tables hold values).
        # Wherever it made a new tensor of the state, the state keeps its values and dtype: the
        # table float32 and exact, the dynamic-NTK length an int64.
        before = [(name, self._buffers[name]) for name in _STATE if name in self._buffers]
        super()._apply(fn, recurse)
        for name, old in before:
            if self._buffers[name] is not old:
                self._buffers[name] = self._restore(name, self._buffers[name], old)
        return self

    def __setattr__(self, name, value):
        # Loaders that build a model on the meta device hand each non-persistent buffer a tensor
        # with no values by setattr (transformers 5's from_pretrained an empty one; under FSDP,
        # a zeroed one on ranks other than 0): state that had no values (meta) is built on the
        # new tensor's device, as by to_empty(), instead of rotating by whatever that memory held.
        # State with values takes what is assigned, as any buffer does. (Swaps by
        # torch.func.functional_call and export write _buffers directly: not seen here.)
        buffers = self.__dict__.get("_buffers")
        if name in _BUILT_FROM and buffers is not None and "_tables" in buffers:
            raise AttributeError(f"RotaryEmbedding: {name} is fixed once the table is built from "
                                 f"it; build a new RotaryEmbedding (from_config, or the "
                                 f"constructor) with {name}={value!r}")
        if name in _STATE and buffers is not None and isinstance(value, torch.Tensor):
            old = buffers.get(name)
            if old is not None and old.is_meta and not value.is_meta:
                value = self._restore(name, value, old)
        super().__setattr__(name, value)

    def __setstate__(self, state):
        # (modules pickled before the scaling was kept as _scaling)
        if "scaling" in state:
            state["_scaling"] = state.pop("scaling")
        super().__setstate__(state)

    def extra_repr(self):
        s = (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, "
             f"max_position={self.max_position}, base={self.base}, interleaved={self.interleaved}")
        if self._scaling is not None:
            s += f", scaling={self._scaling}"
        if self.mode != "static":
            s += f", mode={self.mode}"
        if self.mrope_section is not None:
            s += f", mrope_section={self.mrope_section}, mrope_interleaved={self.mrope_interleaved}"
        if self.rope_dim_offset:
            s += f", rope_dim_offset={self.rope_dim_offset}"
        return s

    # ---- per call ------------------------------------------------------------------------

    def _check_positions(self, positions):
        """Positions in [0, max_position), on every device. Returns their largest value over
        every rank (a 0-d tensor) for DTensor positions, else None."""
        _check_positions_dtype(positions, "RotaryEmbedding")
        dtensor = _dtensor_module(positions)
        if dtensor is not None:
            # Decided from the global extremes, so that every rank raises, or none does (a rank
            # raising alone would leave the others waiting in the next collective).
            lo, hi = _global_extremes(dtensor, positions)
            ok = (lo >= 0) & (hi < self.max_position)
            if positions.device.type == "cpu" and not compiling():
                if not bool(ok):
                    got = int(lo) if int(lo) < 0 else int(hi)
                    raise RuntimeError(f"RotaryEmbedding: positions must lie in [0, {self.max_position}) "
                                       f"(max_position = RotaryEmbedding.max_position), got {got}")
            else:
                torch._assert_async(ok, f"RotaryEmbedding: positions must lie in [0, {self.max_position})")
            return hi
        if positions.device.type == "cpu" and not compiling():
            check_positions_in_range(positions, self.max_position, "RotaryEmbedding",
                                     "RotaryEmbedding.max_position")
        else:  # no sync: an assert on the device
            ok = ((positions >= 0) & (positions < self.max_position)).all()
            torch._assert_async(ok, f"RotaryEmbedding: positions must lie in [0, {self.max_position})")

    def _dynamic_rows(self, positions, largest):
        """The rows of this call, one per position (flattened), and the length it leaves.
        largest: the positions' largest value over every rank (DTensor positions), or None."""
        original = self._original
        # DTensor positions: the call's length over every rank, as a plain tensor (the state
        # buffer is one, and the rows below follow positions).
        length = (_largest(positions) if largest is None else largest).to(torch.int64) + 1
        cached = self.dynamic_len
        # transformers: grow to a longer call; back to the original after a shorter one; a call
        # with no tokens (length <= 0: DTensor extremes of nothing lie far below 0) leaves it.
        new = torch.where(length > cached, length, torch.where(length < original, original, cached))
        new = torch.where(length <= 0, cached, new)
        grown = dynamic_base(float(self.base), self._factor, original, new.to(torch.float64), self._freq_dim)
        base = torch.where(new > original, grown, float(self.base))
        inv_freq = default_inv_freq(self._freq_dim, base, positions.device)
        return cos_sin_rows(positions.reshape(-1), inv_freq, 1.0, torch.float32), new

    def _table_and_index(self, positions):
        """(table, index, length): the op rotates by table[index]; `length` is the dynamic-NTK
        length to keep once the call has succeeded (None when there is none)."""
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"RotaryEmbedding: positions must be a tensor of int32 or int64, got "
                            f"{type(positions).__name__}")
        # No tokens: nothing to rotate, no state to move. A traced call on plain positions does
        # not branch on its token count (it may be data-dependent, or 0 at run time only): its
        # path below takes none as well. (DTensor positions keep the branch: their shards and
        # all-reduce take no empty path.)
        table = self._tables
        if table.is_meta and not positions.is_meta:
            raise RuntimeError(
                "RotaryEmbedding: its table is on the meta device (the module was built under "
                "torch.device('meta') and its state never given memory, which load_state_dict "
                "does not do: the table is not in a state_dict); call .to_empty(device=...) on "
                "the module, which builds it")
        if self.mode == "static" or (
                (not compiling() or _dtensor_module(positions) is not None)
                and positions.numel() == 0):
            return table, positions, None
        largest = self._check_positions(positions)
        if self.mode == "longrope":
            top = _largest(positions) if largest is None else largest
            is_long = (top >= self._original).to(positions.dtype)
            # Negative positions stay negative, so the op still rejects them.
            index = torch.where(positions >= 0, positions + is_long * self._original, positions)
            return table, index, None
        rows, length = self._dynamic_rows(positions, largest)
        index = torch.arange(positions.numel(), device=positions.device).view(positions.shape)
        return rows, index, length

    def _keep(self, length):
        if length is not None:  # only after the op accepted the call: a rejected call changes nothing
            self.dynamic_len.copy_(length)

    def cos_sin(self, positions):
        """(cos, sin), each positions.shape + (rotary_dim/2,), float32 (the attention factor
        included): what forward rotates by at these positions. Advances the dynamic-NTK length
        as forward does. With mrope_section, positions (3, ...) give each component's rows, every
        pair of them; a call takes pair i from the component of its section."""
        table, index, length = self._table_and_index(positions)
        if index.device != table.device:  # torch would index a table by meta positions
            raise RuntimeError(f"RotaryEmbedding.cos_sin: positions must be on the device of the "
                               f"module's table ({table.device}), got {positions.device}")
        if self.mode == "static" and positions.numel():
            self._check_positions(positions)
        rows = table[index.long()]
        self._keep(length)
        half = self.rotary_dim // 2
        return rows[..., :half], rows[..., half:]

    def _section(self, query, key, positions):
        """mrope_section when positions carry the 3 MRoPE components, else None (also for
        positions that are no tensor: _table_and_index names them)."""
        like = query if query is not None else key
        if like is None or not isinstance(positions, torch.Tensor) or positions.dim() != like.dim() - 1:
            return None
        if self.mrope_section is None and positions.shape[0] == 3:
            # (from_config builds plain RoPE where a family's MRoPE sections do not fit the head)
            raise ValueError(f"RotaryEmbedding: positions of shape {list(positions.shape)} hold 3 MRoPE "
                             "components, but the module has no mrope_section: it takes positions "
                             "of shape query.shape[:-2]")
        return self.mrope_section

    def _check_heads(self, query, key):
        """Heads of the module's head_dim (a table for other heads would rotate some of their
        dims by the wrong frequencies, or only a part of them)."""
        for name, t in (("query", query), ("key", key)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"RotaryEmbedding: {name} must be a tensor or None, got "
                                f"{type(t).__name__}")
            if t is not None and (t.dim() == 0 or t.shape[-1] != self.head_dim):
                raise ValueError(f"RotaryEmbedding: {name} of shape {list(t.shape)} must have the "
                                 f"module's head_dim = {self.head_dim} as its last dim")

    def forward(self, query, key, positions):
        """Rotated copies of query and key (None stays None); differentiable w.r.t. both."""
        self._check_heads(query, key)
        section = self._section(query, key, positions)
        table, index, length = self._table_and_index(positions)

        off = self.rope_dim_offset

        def rotate(t, name):
            if t is None:
                return None
            # Text-only positions (no section) are plain RoPE, whatever the sections' layout.
            try:
                out = apply_rope_at(t[..., off:] if off else t, index, table,
                                    interleaved=self.interleaved, mrope_section=section,
                                    mrope_interleaved=self.mrope_interleaved and section is not None)
            except (ValueError, RuntimeError) as e:  # the op calls each tensor x: name it
                if type(e) not in (ValueError, RuntimeError):
                    raise
                raise type(e)(f"RotaryEmbedding, rotating {name} (the op's x): {e}") from None
            return torch.cat((t[..., :off], out), dim=-1) if off else out

        out = rotate(query, "query"), rotate(key, "key")
        self._keep(length)
        return out

    def forward_(self, query, key, positions):
        """In place, the inference path (rope.apply_ or rope.mrope_); returns (query, key)."""
        self._check_heads(query, key)
        section = self._section(query, key, positions)
        table, index, length = self._table_and_index(positions)
        if section is not None:
            out = apply_mrope_(query, key, index, table, section, interleaved=self.interleaved,
                               mrope_interleaved=self.mrope_interleaved,
                               rope_dim_offset=self.rope_dim_offset)
        else:
            out = apply_rope_(query, key, index, table, interleaved=self.interleaved,
                              rope_dim_offset=self.rope_dim_offset)
        self._keep(length)
        return out

