"""trainstream inside training frameworks.

huggingface.py     TrainstreamTrainer / trainstream_trainer (trainstream.hf hands them on), and TrainStream
                   0.2's TrainStreamTrainer
causal_lm_loss.py  a causal LM's training loss without its logits, for TrainstreamTrainer
"""
