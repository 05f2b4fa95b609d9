"""The model-based test's world: the real run path over local files with seams, no Ray
(`tests.modelcheck.world`), and the plain reference model it is checked against
(`tests.modelcheck.reference`)."""
