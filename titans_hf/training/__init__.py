"""Training the memory: `TitansTrainer` (a transformers Trainer), its arguments, and the BABILong recipe behind
`titans-hf train`."""

from .trainer import TitansTrainer
from .training_args import TitansTrainingArguments

__all__ = ["TitansTrainer", "TitansTrainingArguments"]
