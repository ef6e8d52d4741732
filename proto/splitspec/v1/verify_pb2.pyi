from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]

class Quantization(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    QUANTIZATION_UNSPECIFIED: _ClassVar[Quantization]
    QUANTIZATION_NONE: _ClassVar[Quantization]
    QUANTIZATION_INT8: _ClassVar[Quantization]
    QUANTIZATION_FP8_E4M3: _ClassVar[Quantization]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_UNSPECIFIED: _ClassVar[Codec]
    CODEC_NONE: _ClassVar[Codec]
    CODEC_ZSTD: _ClassVar[Codec]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT8: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
QUANTIZATION_UNSPECIFIED: Quantization
QUANTIZATION_NONE: Quantization
QUANTIZATION_INT8: Quantization
QUANTIZATION_FP8_E4M3: Quantization
CODEC_UNSPECIFIED: Codec
CODEC_NONE: Codec
CODEC_ZSTD: Codec

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "quantization", "codec", "data", "scales")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    quantization: Quantization
    codec: Codec
    data: bytes
    scales: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., quantization: _Optional[_Union[Quantization, str]] = ..., codec: _Optional[_Union[Codec, str]] = ..., data: _Optional[bytes] = ..., scales: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "contextual_penalty", "penalty_window")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CONTEXTUAL_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PENALTY_WINDOW_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    contextual_penalty: float
    penalty_window: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., contextual_penalty: _Optional[float] = ..., penalty_window: _Optional[int] = ...) -> None: ...

class FeatureSpec(_message.Message):
    __slots__ = ("hidden_layers", "kv_layers", "quantization", "codec", "lsa_id")
    HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYERS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    LSA_ID_FIELD_NUMBER: _ClassVar[int]
    hidden_layers: _containers.RepeatedScalarFieldContainer[int]
    kv_layers: _containers.RepeatedScalarFieldContainer[int]
    quantization: Quantization
    codec: Codec
    lsa_id: str
    def __init__(self, hidden_layers: _Optional[_Iterable[int]] = ..., kv_layers: _Optional[_Iterable[int]] = ..., quantization: _Optional[_Union[Quantization, str]] = ..., codec: _Optional[_Union[Codec, str]] = ..., lsa_id: _Optional[str] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("start", "count", "hidden", "keys", "values", "lsa")
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    LSA_FIELD_NUMBER: _ClassVar[int]
    start: int
    count: int
    hidden: _containers.RepeatedCompositeFieldContainer[LayerTensor]
    keys: _containers.RepeatedCompositeFieldContainer[LayerTensor]
    values: _containers.RepeatedCompositeFieldContainer[LayerTensor]
    lsa: Tensor
    def __init__(self, start: _Optional[int] = ..., count: _Optional[int] = ..., hidden: _Optional[_Iterable[_Union[LayerTensor, _Mapping]]] = ..., keys: _Optional[_Iterable[_Union[LayerTensor, _Mapping]]] = ..., values: _Optional[_Iterable[_Union[LayerTensor, _Mapping]]] = ..., lsa: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class LayerTensor(_message.Message):
    __slots__ = ("layer", "tensor")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    layer: int
    tensor: Tensor
    def __init__(self, layer: _Optional[int] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ms", "forward_ms", "total_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    forward_ms: float
    total_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., forward_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("model_id", "tokenizer_fingerprint", "vocab_size", "num_layers", "hidden_size", "max_context", "max_tree_nodes", "max_tree_depth", "max_prompt_tokens", "max_sessions", "session_idle_ttl_s", "dtype", "eos_token_ids", "max_draft_support", "lsa_ids")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDLE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_SUPPORT_FIELD_NUMBER: _ClassVar[int]
    LSA_IDS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tokenizer_fingerprint: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    max_context: int
    max_tree_nodes: int
    max_tree_depth: int
    max_prompt_tokens: int
    max_sessions: int
    session_idle_ttl_s: float
    dtype: str
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_draft_support: int
    lsa_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_id: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., max_context: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., max_tree_depth: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., max_sessions: _Optional[int] = ..., session_idle_ttl_s: _Optional[float] = ..., dtype: _Optional[str] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_draft_support: _Optional[int] = ..., lsa_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("prompt_ids", "sampling", "features", "tokenizer_fingerprint", "open_id", "abandoned_opens")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    OPEN_ID_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_OPENS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    features: FeatureSpec
    tokenizer_fingerprint: str
    open_id: bytes
    abandoned_opens: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., features: _Optional[_Union[FeatureSpec, _Mapping]] = ..., tokenizer_fingerprint: _Optional[str] = ..., open_id: _Optional[bytes] = ..., abandoned_opens: _Optional[_Iterable[bytes]] = ...) -> None: ...

class OpenSessionReply(_message.Message):
    __slots__ = ("session_id", "first_token", "features", "timings")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    first_token: int
    features: Features
    timings: Timings
    def __init__(self, session_id: _Optional[bytes] = ..., first_token: _Optional[int] = ..., features: _Optional[_Union[Features, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class DraftTree(_message.Message):
    __slots__ = ("tokens", "parents")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftProbs(_message.Message):
    __slots__ = ("rows", "token_ids", "probs")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedScalarFieldContainer[int]
    token_ids: Tensor
    probs: Tensor
    def __init__(self, rows: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Union[Tensor, _Mapping]] = ..., probs: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "step", "tree", "draft_probs", "forced_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    step: int
    tree: DraftTree
    draft_probs: DraftProbs
    forced_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[bytes] = ..., step: _Optional[int] = ..., tree: _Optional[_Union[DraftTree, _Mapping]] = ..., draft_probs: _Optional[_Union[DraftProbs, _Mapping]] = ..., forced_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyReply(_message.Message):
    __slots__ = ("step", "accepted_nodes", "accepted_tokens", "bonus_token", "bonus_recovered", "features", "timings")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BONUS_RECOVERED_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    step: int
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    accepted_tokens: _containers.RepeatedScalarFieldContainer[int]
    bonus_token: int
    bonus_recovered: bool
    features: Features
    timings: Timings
    def __init__(self, step: _Optional[int] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., accepted_tokens: _Optional[_Iterable[int]] = ..., bonus_token: _Optional[int] = ..., bonus_recovered: _Optional[bool] = ..., features: _Optional[_Union[Features, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    def __init__(self, session_id: _Optional[bytes] = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
