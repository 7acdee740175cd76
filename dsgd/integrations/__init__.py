"""dsgd inside the tools users already have: Keras (``keras``), Ray Data (``data``), TensorBoard (``tensorboard``)."""
