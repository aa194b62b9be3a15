"""Released checkpoints: tokenizers and chat templates (model/hf/tokenizer.py, model/hf/chat_template.py)."""
