from kiln.app.cli import main

main()
