"""The contract between raypipe (the client side) and serve_app (the model service).

Both sides import this package; it imports neither of them, nor Ray:

    raypipe (pipeline, client)        serve_app (deployment, model)
                    \\                  /
                     protos: wire + telemetry
    protos.raypipe.v1  generated gRPC code of `raypipe/v1/emotion.proto` (`make protos`)
    protos.wire        the metadata keys both sides read and write
    protos.telemetry   the metric emitters both sides send through (DogStatsD, Ray metrics)
"""
