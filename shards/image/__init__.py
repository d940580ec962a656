"""Images: decoding bytes to pixels, the uint8 fast path, device-side batch ops, and the transform presets."""
