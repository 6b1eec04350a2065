from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ExpertLoad(_message.Message):
    __slots__ = ("worker_id", "model", "num_layers", "num_experts", "counts", "step", "first_layer", "num_groups", "num_physical_experts", "num_gpus", "gpu_loads", "plan_version", "num_steps")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_PHYSICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_LOADS_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model: str
    num_layers: int
    num_experts: int
    counts: _containers.RepeatedScalarFieldContainer[int]
    step: int
    first_layer: int
    num_groups: int
    num_physical_experts: int
    num_gpus: int
    gpu_loads: _containers.RepeatedScalarFieldContainer[int]
    plan_version: int
    num_steps: int
    def __init__(self, worker_id: _Optional[str] = ..., model: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., counts: _Optional[_Iterable[int]] = ..., step: _Optional[int] = ..., first_layer: _Optional[int] = ..., num_groups: _Optional[int] = ..., num_physical_experts: _Optional[int] = ..., num_gpus: _Optional[int] = ..., gpu_loads: _Optional[_Iterable[int]] = ..., plan_version: _Optional[int] = ..., num_steps: _Optional[int] = ...) -> None: ...

class GetPlanRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ExpertPlan(_message.Message):
    __slots__ = ("model", "version", "num_layers", "num_physical_experts", "phy2log", "balancedness", "num_moved", "num_gpus", "first_layer", "num_experts", "policy", "gpu_loads")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_PHYSICAL_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    PHY2LOG_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    NUM_MOVED_FIELD_NUMBER: _ClassVar[int]
    NUM_GPUS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    GPU_LOADS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: int
    num_layers: int
    num_physical_experts: int
    phy2log: _containers.RepeatedScalarFieldContainer[int]
    balancedness: _containers.RepeatedScalarFieldContainer[float]
    num_moved: int
    num_gpus: int
    first_layer: int
    num_experts: int
    policy: str
    gpu_loads: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, model: _Optional[str] = ..., version: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_physical_experts: _Optional[int] = ..., phy2log: _Optional[_Iterable[int]] = ..., balancedness: _Optional[_Iterable[float]] = ..., num_moved: _Optional[int] = ..., num_gpus: _Optional[int] = ..., first_layer: _Optional[int] = ..., num_experts: _Optional[int] = ..., policy: _Optional[str] = ..., gpu_loads: _Optional[_Iterable[float]] = ...) -> None: ...
