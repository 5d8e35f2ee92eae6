"""`from trainstream.integrations.huggingface import TrainStreamTrainer`: the Hugging Face Trainer of
trainstream.hf (TrainstreamTrainer), under the name TrainStream 0.2 documents."""

from trainstream.hf import TrainstreamTrainer

TrainStreamTrainer = TrainstreamTrainer

__all__ = ["TrainStreamTrainer", "TrainstreamTrainer"]
