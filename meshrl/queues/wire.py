"""The samples' wire format: msgpack via msgspec, for ``put_encoded`` / ``get_batch_encoded``.

Handing Ray a ``list[Sample]`` pickles every struct one by one; one msgpack blob per batch is
cheaper to build and to parse and is the format the pipeline uses between actors (measured in
``bench/bench_queue.py``). The queue itself never materialises the samples of an encoded batch:
it splits the blob into one raw msgpack slice per sample, reads only the fields it schedules by
(``SampleMeta``), and hands the slices back verbatim in ``get_batch_encoded``.

Simplification on purpose: an encoded sample's scalar fields are type-checked on ``put``, its
token lists only for being arrays; element types are checked when the consumer decodes. Blobs
made by ``encode_samples`` from real ``Sample``s are always valid.
"""

from __future__ import annotations

import gc
import struct

import msgspec

from meshrl.queues.sample import Sample

__all__ = ["SampleMeta", "decode_samples", "encode_samples", "encoded_metas", "meta_of", "split_encoded"]

# Built once: constructing an encoder/decoder costs more than encoding a small batch.
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[Sample])
_one_decoder = msgspec.msgpack.Decoder(Sample)
_raw_list_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])


class SampleMeta(msgspec.Struct, frozen=True, gc=False):
    """What the queue needs from a sample to schedule it.

    A Struct, not a NamedTuple: one is built per sample on every ``put``, and a Struct is built in
    C (a NamedTuple's ``__new__`` is Python) and never tracked by the cyclic GC (plain scalars).
    """

    group_id: int
    group_size: int
    behavior_version: int
    num_tokens: int
    t_generated: float


class _EncodedView(msgspec.Struct):
    """The required fields of ``Sample``; the lists stay undecoded (msgspec skips other fields)."""

    prompt_id: int
    group_id: int
    group_size: int
    prompt_ids: msgspec.Raw
    response_ids: msgspec.Raw
    behavior_logprobs: msgspec.Raw
    behavior_version: int
    t_generated: float = 0.0


_views_decoder = msgspec.msgpack.Decoder(list[_EncodedView])


def encode_samples(samples: list[Sample | msgspec.Raw]) -> bytes:
    """One msgpack blob for a batch of samples (raw slices from ``split_encoded`` pass verbatim)."""
    return _encoder.encode(samples)


def decode_samples(blob: bytes) -> list[Sample]:
    """Inverse of ``encode_samples``; a malformed blob raises a ``msgspec.MsgspecError``.

    Decodes with the cyclic GC paused. A 256-sample batch allocates about 1,000 GC-tracked
    lists, enough to start a collection or two mid-decode; none can free anything (the new tree
    is alive and acyclic), yet every tenth young collection escalates, and a full one walks the
    consumer's whole heap. Paused, the batch costs one young collection, after the decode, and
    full collections come about 40% less often (``bench/RESULTS.md``). Thread-safe enough:
    msgspec holds the GIL while it decodes, and a GC someone else disabled stays off.
    """
    if not gc.isenabled():
        return _decoder.decode(blob)
    gc.disable()
    try:
        return _decoder.decode(blob)
    finally:
        gc.enable()


def check_sample(s: Sample) -> None:
    """Raise if ``s`` would not survive the wire (a field of the wrong type: a Struct built in code
    is not type-checked); msgspec's ``TypeError`` or ``MsgspecError`` says which field."""
    _one_decoder.decode(_encoder.encode(s))


def decode_one(item: Sample | msgspec.Raw) -> Sample:
    return item if isinstance(item, Sample) else _one_decoder.decode(item)


def meta_of(s: Sample) -> SampleMeta:
    return SampleMeta(s.group_id, s.group_size, s.behavior_version,
                      len(s.prompt_ids) + len(s.response_ids), s.t_generated)


def split_encoded(blob: bytes) -> tuple[list[msgspec.Raw], list[SampleMeta]]:
    """One raw slice and its ``SampleMeta`` per sample of an ``encode_samples`` blob.

    Raises ``ValueError`` naming the problem when the blob is not a list of samples.
    """
    metas = encoded_metas(blob)
    # A Raw slice keeps its whole source blob alive; copies let a straggling group hold
    # only its own bytes (capacity_tokens would not see the rest).
    return [r.copy() for r in _raw_list_decoder.decode(blob)], metas


def encoded_metas(blob: bytes) -> list[SampleMeta]:
    """The ``SampleMeta`` of each sample of an ``encode_samples`` blob (its arrays stay undecoded)."""
    try:
        views = _views_decoder.decode(blob)
    except msgspec.MsgspecError as e:
        raise ValueError(f"put_encoded: the blob is not a msgpack list of Sample: {e}") from None
    return [SampleMeta(v.group_id, v.group_size, v.behavior_version,
                       _array_len(v.prompt_ids) + _array_len(v.response_ids), v.t_generated)
            for v in views]


_u8 = struct.Struct(">B").unpack_from
_u16 = struct.Struct(">H").unpack_from
_u32 = struct.Struct(">I").unpack_from


def _array_len(raw: msgspec.Raw) -> int:
    """Length from a msgpack array header, without decoding the elements.

    ``struct`` reads the Raw's buffer in place: twice as fast as slicing a memoryview, and this
    runs twice per sample on every ``put_encoded``.
    """
    (head,) = _u8(raw)
    if 0x90 <= head <= 0x9F:  # fixarray
        return head & 0x0F
    if head == 0xDC:  # array 16
        return _u16(raw, 1)[0]
    if head == 0xDD:  # array 32
        return _u32(raw, 1)[0]
    raise ValueError("put_encoded: a sample's prompt_ids or response_ids is not an array")
