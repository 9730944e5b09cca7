from streamer.cli import main

main()
