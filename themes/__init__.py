"""Console stylesheets and theme definitions (data only). Found via runtime.resources."""
