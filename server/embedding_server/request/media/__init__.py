"""Image inputs on the request plane: fetching them (:mod:`.fetching`), the request shapes that
carry them (:mod:`.inputs`), and the model's own preprocessing (:mod:`.preprocessing`)."""
