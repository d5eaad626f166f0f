"""Layer-streamed execution: run an encoder whose weights stay in their safetensors file (``--offload``).

A BERT-family encoder makes one forward pass per window and generates nothing, so each layer's weights can
be read once and run over a whole *block* of windows before the next layer is read: the cost of reading
them is spread over every token of the block. The process holds, beside the block's hidden states, the
small parts of the model (position and segment embeddings, layer norms, pooler, a classifier's head), the
word-embedding rows of the tokens that occur in the block, and one layer's weights; on CUDA two, the next one
read and copied while one runs (:func:`reads_ahead`).

The math is transformers' own: the model is built from its config with one encoder layer and a
word-embedding table of one row, its encoder is replaced by a *seam* (:class:`_EncoderSeam`) and the model's
own ``forward`` is called once per (layer, sub-batch). The seam runs the real encoder class (one layer slot,
filled with layer ``i``'s weights) on the sub-batch's held hidden states, with the attention mask and
arguments the model itself just built, and returns its output as the encoder's. So embeddings (position ids
and all), masks, MPNet's relative position bias, the pooler and a classifier's head are computed exactly as
on the resident path, and the last layer's call returns the same output object that
:class:`~memfit.engine.batches.TorchEngine` hands its head.

**Why the file is read with ``pread``, not memory-mapped.** Pages of a memory-mapped file that the process
touches count in its resident set until they are unmapped or evicted, and the kernel maps neighbouring
cached pages on every fault (fault-around): read through a mapping, every layer would stay in the resident
set after it ran, and the whole file would end up in the peak the budget bounds. Reading into our own
buffers holds only those buffers; the file's pages stay in the page cache, shared, outside the process.
On CUDA the buffers are pinned, so the copy to the device does not block the host, and each layer, once read and
converted to the compute dtype, stays in pinned host memory for the blocks after the first where the host has room
for all of them (:func:`keeps_layers_on_host`): a GPU's budget is its own memory, and a block of a GPU's size runs a
layer in a few milliseconds, while reading and converting it from the file took more (an H200 with 16 host cores
streamed a bert-base-shaped model at 0.35x of the resident speed, every block reading every layer from the file).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from memfit.data.chunking import Window
from memfit.engine.batches import Engine, Head, inference_pad_multiple, pad_windows
from memfit.engine.cpu_linears import use_onednn_linears
from memfit.engine.checkpoint import (
    FILE_DTYPE_BYTES,
    FLOAT_FILE_DTYPES,
    WEIGHTS_FILE,
    HeaderEntry,
    bytes_in_memory,
    read_header,
    weights_file,
)
from memfit.errors import ConfigError, ModelLoadError
from memfit.memory.calibration import Network, torch_runtime
from memfit.memory.model import device_memory
from memfit.memory.planner import BatchBudget, plan_batches
from memfit.memory.device import Device, DtypeName, torch_dtype

_ALIGNMENT = 64  # bytes between the tensors of a layer's one buffer: every dtype's views stay aligned

_FILE_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class WeightFile:
    """One safetensors file, read tensor by tensor (and row by row) with ``pread`` (module docstring: why not
    a memory map). Thread-safe: ``pread`` has no file position."""

    def __init__(self, path: Path):
        self.path = path
        self.entries = read_header(path)
        self._fd = os.open(path, os.O_RDONLY)

    def close(self) -> None:
        os.close(self._fd)

    def _read_into(self, buffer: torch.Tensor, offset: int) -> None:
        view = memoryview(buffer.numpy()).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise ModelLoadError(f"{self.path} ended early: it is truncated or being replaced")
            done += got

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name``, in the file's dtype, in a fresh host buffer (the model's small parts: a layer is read
        over buffers of its own, :meth:`read_over`)."""
        entry = self.entries[name]
        buffer = torch.empty(entry.nbytes, dtype=torch.uint8)
        self._read_into(buffer, entry.offset)
        return buffer.view(_FILE_DTYPES[entry.dtype]).reshape(entry.shape)

    def read_over(self, name: str, out: torch.Tensor, staging: torch.Tensor | None) -> None:
        """The tensor ``name`` read over ``out`` (contiguous, its shape), converted to ``out``'s dtype through
        ``staging`` (uint8, at least the tensor's bytes) where the file holds another."""
        entry = self.entries[name]
        if _FILE_DTYPES[entry.dtype] == out.dtype:
            self._read_into(out.reshape(-1).view(torch.uint8), entry.offset)
            return
        assert staging is not None, "This is a bug: a conversion needs a staging buffer"
        self._read_into(staging[: entry.nbytes], entry.offset)
        out.copy_(staging[: entry.nbytes].view(_FILE_DTYPES[entry.dtype]).reshape(entry.shape))

    def rows(self, name: str, ids: np.ndarray) -> torch.Tensor:
        """Rows ``ids`` (sorted, unique) of the 2-D tensor ``name``: one read per run of consecutive ids."""
        entry = self.entries[name]
        row_bytes = entry.nbytes // entry.shape[0]
        buffer = torch.empty(len(ids) * row_bytes, dtype=torch.uint8)
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        for begin, end in zip(np.concatenate([[0], breaks]), np.concatenate([breaks, [len(ids)]])):
            self._read_into(buffer[begin * row_bytes : end * row_bytes], entry.offset + int(ids[begin]) * row_bytes)
        return buffer.view(_FILE_DTYPES[entry.dtype]).reshape(len(ids), *entry.shape[1:])

    def bytes_of(self, names: Sequence[str], dtype: DtypeName) -> int:
        """What ``names`` take in memory once converted to ``dtype`` (floats) or as stored (the rest)."""
        return bytes_in_memory(self.entries, names, dtype)


class _GatheredRows(torch.nn.Module):
    """Stands in for the word-embedding table: the rows of the block's tokens, looked up by token id."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: torch.Tensor | None = None  # (n,) sorted token ids on the device
        self.table: torch.Tensor | None = None  # (n, hidden) their rows, compute dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.ids is not None and self.table is not None, "This is a bug: rows used outside a block"
        return self.table[torch.searchsorted(self.ids, input_ids)]


class _EncoderSeam(torch.nn.Module):
    """Where the model's own forward calls its encoder: runs ``step`` instead (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.step: Callable[..., Any] | None = None

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        assert self.step is not None, "This is a bug: the encoder seam was called outside a block"
        return self.step(hidden_states, *args, **kwargs)


@dataclass
class _Skeleton:
    """The model with its encoder swapped for the seam: what :class:`StreamedBackend` calls."""

    model: torch.nn.Module
    rows: _GatheredRows
    seam: _EncoderSeam
    encoder: torch.nn.Module  # the real encoder class, with one layer slot
    slot: torch.nn.Module  # encoder.layer[0]
    word_key: str  # the word-embedding table's name in the file
    layer_keys: list[dict[str, str]]  # per layer: slot parameter name -> name in the file
    resident_bytes: int  # the small parts' weights, held for the whole run
    kernels: str | None  # where its products run other than PyTorch's default (cpu_linears.ONEDNN_LINEARS)


def _file_name(key: str, prefix: str, names: dict[str, HeaderEntry]) -> str | None:
    """The file's name for the model's parameter ``key``: as is, or with / without the base model's prefix
    (a classifier's checkpoint embedded with ``AutoModel``, or the reverse)."""
    for candidate in (key, f"{prefix}.{key}", key.removeprefix(f"{prefix}.")):
        if candidate in names:
            return candidate
    return None


def _one_row_position_bias(compute: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """MPNet's relative position bias depends on the positions alone, yet transformers copies it out to every row
    of the batch (``expand(...).contiguous()``) each time its encoder runs: once a forward on the resident path,
    once per (layer, sub-batch) here, where that copy took 2.5 of 37.8 s (all-mpnet-base-v2, 120 texts). Computed
    for one row and broadcast, the same values are added to the attention scores, and no batch-sized copy is
    written. Position ids given per row keep transformers' own computation."""

    def one_row_broadcast(x: torch.Tensor, position_ids: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if position_ids is not None:
            return compute(x, position_ids=position_ids, **kwargs)
        return compute(x[:1], **kwargs).expand(x.size(0), -1, -1, -1)

    return one_row_broadcast


def _build_skeleton(
    name: str, task: str, config: Any, weights: WeightFile, device: Device, dtype: torch.dtype
) -> _Skeleton:
    from transformers import AutoModel, AutoModelForSequenceClassification

    small = copy.deepcopy(config)
    small.num_hidden_layers = 1
    # the padding row must exist: the config's, and MPNet's embeddings hard-code padding_idx 1 whatever it says
    small.vocab_size = max(int(getattr(config, "pad_token_id", 0) or 0) + 1, 2)
    auto = AutoModel if task == "embedding" else AutoModelForSequenceClassification
    model = auto.from_config(small, dtype=dtype).eval()
    base = model.base_model
    prefix = getattr(model, "base_model_prefix", "")
    in_base = "" if base is model else f"{prefix}."
    encoder = getattr(base, "encoder", None)
    layers = getattr(encoder, "layer", None)
    if not isinstance(layers, torch.nn.ModuleList) or base.get_input_embeddings() is None:
        raise ConfigError(f"--offload cannot stream {type(model).__name__}: it has no encoder.layer list")
    word_key = _file_name(f"{in_base}embeddings.word_embeddings.weight", prefix, weights.entries)
    if word_key is None:
        raise ModelLoadError(f"{name}: {WEIGHTS_FILE} has no word-embedding table")
    if callable(getattr(encoder, "compute_position_bias", None)):
        encoder.compute_position_bias = _one_row_position_bias(encoder.compute_position_bias)
    slot = layers[0]
    layer_names = [f"{in_base}encoder.layer.0.{key}" for key in slot.state_dict()]
    small_state: dict[str, torch.Tensor] = {}
    for key in model.state_dict():
        if key in layer_names or key.endswith("word_embeddings.weight"):
            continue
        found = _file_name(key, prefix, weights.entries)
        if found is None:
            if key.startswith(f"{in_base}pooler.") and task == "embedding":
                continue  # memfit pools by itself and never uses the pooler (as models._report_loading)
            raise ModelLoadError(f"{name}: {WEIGHTS_FILE} has no weight {key}; it cannot be streamed")
        tensor = weights.read(found)
        small_state[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    model.load_state_dict(small_state, strict=False, assign=True)
    rows, seam = _GatheredRows(), _EncoderSeam()
    base.set_input_embeddings(rows)
    base.encoder = seam
    layer_keys = []
    for index in range(int(config.num_hidden_layers)):
        keys = {}
        for key in slot.state_dict():
            found = _file_name(f"encoder.layer.{index}.{key}", prefix, weights.entries)
            if found is None:
                raise ModelLoadError(f"{name}: {WEIGHTS_FILE} has no weight encoder.layer.{index}.{key}")
            keys[key] = found
        layer_keys.append(keys)
    model.to(device)
    encoder.to(device)
    slot.to_empty(device="meta")  # its random weights go: each forward fills it from the file
    # fp32 on a CPU where oneDNN runs the layers' products faster (cpu_linears.py), measured once the random layer
    # is gone; each layer's weights, assigned to the slot's switched modules, keep the switch
    kernels = use_onednn_linears(encoder, model) if device.type == "cpu" else None
    resident = sum(t.numel() * t.element_size() for t in small_state.values())
    return _Skeleton(model, rows, seam, encoder, slot, word_key, layer_keys, resident, kernels)


@dataclass(frozen=True)
class StreamedBackend:
    """An encoder run layer by layer from its safetensors file (module docstring): the backend ``streamed``.

    ``layer_budget`` sizes the sub-batches one layer runs on at a time (the plan's per-layer activation room);
    the block a forward receives is sized by the plan's held-states term (``memory/model.plan_streamed``)."""

    name_or_path: str
    task: str
    config: Any
    device: Device
    dtype: DtypeName
    pad_token_id: int
    weights: WeightFile
    skeleton: _Skeleton
    layer_budget: BatchBudget
    lock: threading.Lock
    # each layer's weights in the compute dtype, in pinned host memory, once read (CUDA, where the host has room:
    # :func:`keeps_layers_on_host`); None: every block reads every layer from the file again
    host_layers: dict[int, dict[str, torch.Tensor]] | None = None

    name = "streamed"
    module = None  # no whole PyTorch module: one layer at a time
    retries_fp32 = False

    def guard_identity(self) -> str | None:
        return None  # PyTorch's kernels: reduced precision is measured on every run

    def release_buffers(self) -> None:
        pass  # a block's states and its layer's weights are freed when it ends

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def layer_bytes(self) -> int:
        """One layer's weights in the compute dtype (the largest layer: they are all alike in an encoder)."""
        return max(self.weights.bytes_of(list(keys.values()), self.dtype) for keys in self.skeleton.layer_keys)

    @property
    def held_layers_bytes(self) -> int:
        """The layers' weights held at once while a block runs (:func:`layers_held`)."""
        return layers_held(self.device) * self.layer_bytes

    @property
    def held_weight_bytes(self) -> int:
        """Weights held while a block runs: the small parts and the layers held at once."""
        return self.skeleton.resident_bytes + self.held_layers_bytes

    @property
    def network(self) -> Network:
        """What calibration and the planner see: one probe is one streamed forward of one sub-batch, so its
        growth includes the layers' weights it holds and the rows it reads (they land in the fixed term).

        A probe runs the first layer, the second and the last (:func:`probe_layers`): a streamed forward holds one
        layer's weights and work at a time (with the next layer read beside it on CUDA), and every layer of an
        encoder has the same shapes, so the layers between the second and the last repeat the second's peak. The
        first runs the embeddings and builds the mask, the last the model's output: those three hold the whole
        forward's peak in a quarter of the layers' time on a 12-layer model, where a cold calibration of
        all-mpnet-base-v2 spent ~20 s running every layer (docs/memory.md)."""

        def probe(batch: int, length: int) -> None:
            vocab = int(self.config.vocab_size)
            generator = torch.Generator().manual_seed(0)
            ids = torch.randint(min(5, vocab - 1), vocab, (batch, length), generator=generator).tolist()
            windows = [Window(row, 0, np.asarray(ids_row), None, 0, length) for row, ids_row in enumerate(ids)]
            self.run(
                windows,
                lambda output, mask, chosen: [None] * len(chosen),
                BatchBudget(batch * length, batch),
                layer_order=probe_layers(len(self.skeleton.layer_keys)),
            )

        return Network(
            config=self.config,
            compute_dtype=self.dtype,
            weights_bytes=self.held_weight_bytes,
            attention=str(getattr(self.skeleton.model.config, "_attn_implementation", None) or "eager"),
            attention_materialized=getattr(self.skeleton.model.config, "_attn_implementation", "eager") == "eager",
            runtime=torch_runtime(self.skeleton.kernels),
            # the probes' fixed term holds the layers held at once: calibrations with another count are not this one
            kind=f"streamed {type(self.skeleton.model).__name__}, {layers_held(self.device)} layer(s) held",
            probe=probe,
            probe_held_bytes=self.held_layers_bytes,
        )

    def held_bytes_per_token(self, output_bytes_per_token: float, window: int) -> float:
        """What a block holds per padded token between layers: its hidden state, its word-embedding row (read in
        the file's dtype, then converted: both count, at worst one distinct token per position), the attention
        mask the model built for its sub-batch (kept from the first layer to the last, so the model's own
        forward, embeddings included, runs only there: a (batch, 1, length, length) mask is at most ``window``
        elements per token; counted at 4 bytes, the widest a mask is built in) and its output in flight."""
        hidden = int(self.config.hidden_size)
        element = self.compute_dtype.itemsize
        file_element = FILE_DTYPE_BYTES[self.weights.entries[self.skeleton.word_key].dtype]
        return hidden * element + hidden * (file_element + element) + 4 * window + output_bytes_per_token

    def engine(self, head: Head) -> Engine:
        return StreamedEngine(self, head)

    def fp32_reference(self) -> Callable[[Head], Engine]:
        """The same streamed model in fp32, for the quality guard."""
        return lambda head: load_streamed(
            self.name_or_path, self.task, self.config, self.device, "fp32", self.pad_token_id
        ).engine(head)

    def fp32_copy_bytes(self) -> int:
        """What the fp32 reference holds beside this one: its small parts and its layers held at once, in fp32."""
        return self.skeleton.resident_bytes * 4 // self.compute_dtype.itemsize + layers_held(
            self.device
        ) * self.weights.bytes_of(list(self.skeleton.layer_keys[0].values()), "fp32")

    def with_layer_budget(self, layer_budget: BatchBudget) -> "StreamedBackend":
        """This backend, its sub-batches sized by the memory plan."""
        return dataclasses.replace(self, layer_budget=layer_budget)

    def _read_layer(self, index: int) -> dict[str, torch.Tensor]:
        """Layer ``index``'s weights in the compute dtype (floats; the rest as stored): views of one fresh buffer,
        pinned on CUDA, read as :meth:`_read_layer_over` reads over a layer, so that one allocation holds the layer and
        a kept one is not rounded up tensor by tensor (the pinned allocator rounds each buffer to a power of two); or
        the layer kept on the host (:attr:`host_layers`) since an earlier block read it. A kept layer is read-only:
        only CUDA's path keeps any, and it copies them."""
        if self.host_layers is not None and index in self.host_layers:
            return self.host_layers[index]
        keys = self.skeleton.layer_keys[index]
        entries = self.weights.entries
        sizes = {key: self.weights.bytes_of([name], self.dtype) for key, name in keys.items()}
        offsets, total = {}, 0
        for key in keys:
            offsets[key], total = total, total + -(-sizes[key] // _ALIGNMENT) * _ALIGNMENT
        buffer = torch.empty(total, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        views = {}
        for key, name in keys.items():
            stored = entries[name].dtype
            dtype = self.compute_dtype if stored in FLOAT_FILE_DTYPES else _FILE_DTYPES[stored]
            views[key] = buffer[offsets[key] : offsets[key] + sizes[key]].view(dtype).reshape(entries[name].shape)
        state = self._read_layer_over(index, views)
        if self.host_layers is not None:
            self.host_layers[index] = state
        return state

    def _read_layer_over(self, index: int, held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Layer ``index``'s weights read over ``held``: the layer that just ran (on the CPU, where nothing else uses
        it any more), or a fresh layer's empty views (:meth:`_read_layer`). A fresh buffer of a layer's size is mapped,
        faulted in and zeroed by the kernel before the file is copied into it: all-mpnet-base-v2's 27 MiB fp32 layer
        read in 19 ms fresh against 3.5-3.9 ms over the last one's (2-core AMD EPYC 25/17/1). A tensor the file holds
        in another dtype passes through one staging buffer of the largest such tensor."""
        keys = self.skeleton.layer_keys[index]
        entries = self.weights.entries
        converted = [
            entries[name].nbytes for key, name in keys.items() if _FILE_DTYPES[entries[name].dtype] != held[key].dtype
        ]
        staging = torch.empty(max(converted), dtype=torch.uint8) if converted else None
        for key, name in keys.items():
            if tuple(held[key].shape) != entries[name].shape:
                shapes = f"{entries[name].shape}, not {tuple(held[key].shape)}"
                raise ModelLoadError(f"{self.weights.path}: {name} is {shapes} as the layer before it")
            self.weights.read_over(name, held[key], staging)
        return held

    def run(
        self,
        windows: Sequence[Window],
        head: Head,
        layer_budget: BatchBudget | None = None,
        layer_order: Sequence[int] | None = None,
    ) -> list:
        """Every window of the block through every layer, layer-major; ``head``'s result per window, in order.
        ``layer_order``: the layers' indices in the order they run (default: all of them; calibration's probes run
        fewer, see :attr:`network`).

        One forward at a time (a lock): a second block beside this one would hold a second set of layers."""
        skeleton = self.skeleton
        order = list(range(len(skeleton.layer_keys))) if layer_order is None else list(layer_order)
        batches = plan_batches([len(w) for w in windows], layer_budget or self.layer_budget)
        multiple = inference_pad_multiple(self.device)
        results: list[Any] = [None] * len(windows)
        read_ahead = reads_ahead(self.device)
        # the CPU reads each layer over the one that ran (_read_layer_over): over a kept layer it would overwrite it
        assert read_ahead or self.host_layers is None, "This is a bug: layers kept on the host of a CPU run"
        with self.lock, torch.inference_mode(), ThreadPoolExecutor(1, thread_name_prefix="memfit-layers") as reader:
            tokens = [np.asarray(w.input_ids, dtype=np.int64) for w in windows] + [np.array([self.pad_token_id])]
            ids = np.unique(np.concatenate(tokens))  # padding positions look up the pad row too
            table = self.weights.rows(skeleton.word_key, ids)
            skeleton.rows.table = table.to(self.compute_dtype).to(self.device)
            skeleton.rows.ids = torch.from_numpy(ids).to(self.device)
            del table
            held: list[torch.Tensor | None] = [None] * len(batches)  # each sub-batch's hidden states
            calls: list[tuple[tuple, dict] | None] = [None] * len(batches)  # the mask etc. the model built
            layers = len(order)
            reading: Future | None = reader.submit(self._read_layer, order[0])
            try:
                for layer in range(layers):
                    assert reading is not None
                    read, reading = reading.result(), None  # a finished future would keep the buffers alive
                    state = {key: t.to(self.device, non_blocking=True) for key, t in read.items()}
                    skeleton.slot.load_state_dict(state, assign=True)
                    del read, state
                    if read_ahead and layer + 1 < layers:
                        reading = reader.submit(self._read_layer, order[layer + 1])
                    for number, batch in enumerate(batches):
                        if 0 < layer < layers - 1:  # between the first and the last layer, the model's own
                            args, kwargs = calls[number]  # type: ignore[misc]  # forward is not needed
                            held[number] = skeleton.encoder(held[number], *args, **kwargs)[0]
                            continue
                        chosen = [windows[i] for i in batch]
                        inputs = pad_windows(chosen, self.pad_token_id, self.device, multiple=multiple)

                        def step(embedded: torch.Tensor, *args: Any, _n: int = number, **kwargs: Any) -> Any:
                            first = calls[_n] is None
                            encoded = skeleton.encoder(embedded if first else held[_n], *args, **kwargs)
                            held[_n], calls[_n] = encoded[0], (args, kwargs)
                            return encoded  # the encoder's own output type, as the model expects it

                        skeleton.seam.step = step
                        output = skeleton.model(**inputs)
                        if layer == layers - 1:
                            held[number] = calls[number] = None
                            for i, result in zip(batch, head(output, inputs["attention_mask"], chosen)):
                                results[i] = result
                        del output
                    if not read_ahead and layer + 1 < layers:  # the next layer's weights over this one's
                        reading = reader.submit(self._read_layer_over, order[layer + 1], skeleton.slot.state_dict())
            finally:
                skeleton.seam.step = None
                skeleton.rows.ids = skeleton.rows.table = None
                skeleton.slot.to_empty(device="meta")
        return results


def reads_ahead(device: Device) -> bool:
    """Whether the next layer is read while one runs. On CUDA the read and the copy to the device overlap the
    GPU's work. On the CPU they would only hold a second layer's weights: the read (all-mpnet-base-v2: 27 MiB of
    fp32 weights from the page cache in 19 ms into fresh buffers) is a small part of a layer's time over a block,
    and a reader thread takes its CPU time from the forward's threads anyway. In-process, 150 long-tail texts at
    900 MiB, fp32: 92.1 and 113.0 s reading ahead, 90.0 and 102.5 s not, alternating (docs/memory.md). Not reading
    ahead lowers the smallest streamed budget by one layer (27 MiB there)."""
    return device.type != "cpu"


def keeps_layers_on_host(device: Device, layer_bytes: Sequence[int]) -> bool:
    """Whether a streamed run keeps every layer, once read, in pinned host memory (:attr:`StreamedBackend.host_layers`):
    on a GPU, whose budget is its own memory, where the layers (``layer_bytes``, each in the compute dtype, rounded up
    to a power of two as the pinned allocator holds them) take at most half of the host's free memory (within a
    cgroup's limit). Never on the CPU: there host memory is the budget, and a block's layer time dwarfs the read
    (:func:`reads_ahead`)."""
    if device.type != "cuda":
        return False
    pinned = sum(1 << max(0, size - 1).bit_length() for size in layer_bytes)
    return pinned <= device_memory(Device("cpu")).free_bytes // 2


def layers_held(device: Device) -> int:
    """The layers' weights held at once while a block runs: one, or two where the next is read ahead."""
    return 2 if reads_ahead(device) else 1


def probe_layers(count: int) -> list[int]:
    """The layers a calibration probe runs, in order, of a model with ``count``: the first (embeddings and mask),
    the second (a layer between, read as every later one is) and the last (the output)."""
    return sorted({0, min(1, count - 1), count - 1})


class StreamedEngine:
    """:class:`~memfit.engine.batches.Engine` on a :class:`StreamedBackend`: a forward is a block, run
    layer-major in sub-batches; one result per window, as :class:`~memfit.engine.batches.TorchEngine` gives."""

    def __init__(self, backend: StreamedBackend, head: Head):
        self.backend = backend
        self.head = head

    def forward(self, windows: Sequence[Window]) -> list:
        return self.backend.run(windows, self.head)


def load_streamed(
    name: str,
    task: str,
    config: Any,
    device: Device,
    dtype: DtypeName,
    pad_token_id: int,
    keep_layers: bool = False,
) -> StreamedBackend:
    """The streamed backend of the model ``name`` (a directory, or a hub id whose weights are in the Hugging Face
    cache: :func:`~memfit.engine.checkpoint.weights_file`): the small parts loaded, the layers left in the
    file. ``keep_layers``: keep each layer on the host once read, where :func:`keeps_layers_on_host` allows (a run's
    backend; the quality guard's fp32 reference runs one block and keeps none). Raises
    :class:`~memfit.errors.ConfigError` for a model it cannot stream (no single safetensors file, no ``encoder.layer``
    list)."""
    path = weights_file(name)
    if path is None:
        raise ConfigError(
            f"--offload streams weights from a local {WEIGHTS_FILE}; {name} has none (sharded, .bin, or a hub model "
            "not downloaded yet)"
        )
    weights = WeightFile(path)
    skeleton = _build_skeleton(name, task, config, weights, device, torch_dtype(dtype))
    layer_bytes = [weights.bytes_of(list(keys.values()), dtype) for keys in skeleton.layer_keys]
    return StreamedBackend(
        name_or_path=name,
        task=task,
        config=config,
        device=device,
        dtype=dtype,
        pad_token_id=pad_token_id,
        weights=weights,
        skeleton=skeleton,
        layer_budget=BatchBudget(max_batch_tokens=2_048, max_batch_seqs=4096),
        lock=threading.Lock(),
        host_layers={} if keep_layers and keeps_layers_on_host(device, layer_bytes) else None,
    )
