from kvcanary.monitor.commands.cli import main

main()
