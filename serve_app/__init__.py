"""serve_app: the EmotionClassifier Ray Serve application (the server side of raypipe).

`app` (the deployment and its gRPC methods) · `model` (load a model directory, run it with
length bucketing) · `settings` (server settings, fault injection) · `deploy` (start Serve's
gRPC proxy and run the app) · `demo_model` / `demo_data` (the offline demo model).
It imports only the generated protos from `raypipe`, never its pipeline.
"""
