"""How a checkpoint is laid out in bytes: tensor files, the manifest, the value codec, torch.save import."""
