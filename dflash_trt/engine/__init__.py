"""The engine directory: the one artifact `dflash-trt build` writes and every later step reads."""
