"""trainstream's integrations with training frameworks, under the names TrainStream 0.2 documents."""
