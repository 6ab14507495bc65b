"""Data: SFT samples (chat + metadata), readers, mixing, dedup, decontamination, tokenization, packing."""

from posttrain.data.schema import DataError, RecordError, SampleMetadata, SFTSample, validate_record

__all__ = ["DataError", "RecordError", "SFTSample", "SampleMetadata", "validate_record"]
