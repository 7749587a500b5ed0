"""Arguments, validation and the training loop: wires model, data, parallel and DeepSpeed."""
