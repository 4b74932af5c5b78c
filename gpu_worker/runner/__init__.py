"""Between the engine and the model: how a step's forward runs on its device."""
