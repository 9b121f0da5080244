"""Training the memory: `TitansTrainer` (a transformers Trainer) and the BABILong recipe behind `titans-hf train`."""

from .trainer import ChunkCurriculumSampler, TitansTrainer, TitansTrainingArguments

__all__ = ["ChunkCurriculumSampler", "TitansTrainer", "TitansTrainingArguments"]
