from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Paragraph(_message.Message):
    __slots__ = ("id", "text")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    id: str
    text: str
    def __init__(self, id: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class ClassifyRequest(_message.Message):
    __slots__ = ("paragraphs", "ids", "texts")
    PARAGRAPHS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    paragraphs: _containers.RepeatedCompositeFieldContainer[Paragraph]
    ids: _containers.RepeatedScalarFieldContainer[str]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, paragraphs: _Optional[_Iterable[_Union[Paragraph, _Mapping]]] = ..., ids: _Optional[_Iterable[str]] = ..., texts: _Optional[_Iterable[str]] = ...) -> None: ...

class Prediction(_message.Message):
    __slots__ = ("id", "probabilities", "truncated")
    ID_FIELD_NUMBER: _ClassVar[int]
    PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    id: str
    probabilities: _containers.RepeatedScalarFieldContainer[float]
    truncated: bool
    def __init__(self, id: _Optional[str] = ..., probabilities: _Optional[_Iterable[float]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("predictions", "labels", "model_version", "setting", "probabilities", "truncated")
    PREDICTIONS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SETTING_FIELD_NUMBER: _ClassVar[int]
    PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    predictions: _containers.RepeatedCompositeFieldContainer[Prediction]
    labels: _containers.RepeatedScalarFieldContainer[str]
    model_version: str
    setting: str
    probabilities: bytes
    truncated: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, predictions: _Optional[_Iterable[_Union[Prediction, _Mapping]]] = ..., labels: _Optional[_Iterable[str]] = ..., model_version: _Optional[str] = ..., setting: _Optional[str] = ..., probabilities: _Optional[bytes] = ..., truncated: _Optional[_Iterable[bool]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfoResponse(_message.Message):
    __slots__ = ("labels", "model_version", "max_sequence_length", "max_batch_size", "setting", "columns")
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SETTING_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.RepeatedScalarFieldContainer[str]
    model_version: str
    max_sequence_length: int
    max_batch_size: int
    setting: str
    columns: bool
    def __init__(self, labels: _Optional[_Iterable[str]] = ..., model_version: _Optional[str] = ..., max_sequence_length: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., setting: _Optional[str] = ..., columns: _Optional[bool] = ...) -> None: ...
