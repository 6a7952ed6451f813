from kdev.cli import main

if __name__ == "__main__":  # fuzz workers are spawned processes: importing this module must not run the CLI
    main()
