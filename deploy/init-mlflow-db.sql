-- Run once by the postgres image on first start (docker-compose.yaml): MLflow's own database.
CREATE DATABASE mlflow OWNER recompute;
